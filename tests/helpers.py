"""Test helpers that drive the model runner directly, below the scheduler."""

from __future__ import annotations

import torch

from servelm.engine.model_runner import SeqInput


def run_seqs(engine, seqs: list[tuple[list[int], int, str]]) -> torch.Tensor:
    """Run (token_ids, start_pos, owner_id) sequences in one forward; logits in input order.

    Blocks come from the engine's own block manager under owner_id, so a sequence can
    continue in a later call; release them with release().
    """
    bm = engine.block_manager
    inputs = []
    for ids, start, owner in seqs:
        bm.allocate(owner, start + len(ids))
        inputs.append(SeqInput(ids, start, bm.block_table(owner), True))
    logits, rows = engine.runner.execute(inputs)
    order = sorted(range(len(rows)), key=lambda r: rows[r])
    return logits[order]


def tile_targets(module: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Swap the bf16/fp32 nn.Linear children called `names` (anywhere below module) for
    the "tiles" linear method's TiledLinear; returns how many were swapped."""
    from servelm.layers import linear_methods as lm

    swaps = [(parent, name, child) for parent in module.modules()
             for name, child in parent.named_children()
             if name in names and type(child) is torch.nn.Linear
             and lm.applies("tiles", child, child.weight.dtype, True)]
    for parent, name, child in swaps:
        setattr(parent, name, lm.build("tiles", child, child.weight.dtype))
    return len(swaps)


def release(engine, *owners: str) -> None:
    for o in owners:
        engine.block_manager.free(o)


def prompt_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits after each whole prompt, all prompts in one batch."""
    owners = [f"probe-{i}" for i in range(len(prompts))]
    try:
        return run_seqs(engine, [(p, 0, o) for p, o in zip(prompts, owners)])
    finally:
        release(engine, *owners)
