"""Activation calibration: one forward pass of a text through the model, recording each
calibrated layer's largest |input| per channel, which the w8a8 linear method smooths by
(servelm.layers.w8a8, SmoothQuant).

Decided once at start-up by KernelConfig.int8_activations ("auto": wherever the w8a8 method
can run; "off": never): on the CPU with servelm's kernels and bf16 activations, or on a CUDA
device whose int8 tensor cores Triton drives (bf16 or fp16 activations), a model of
attention layers alone (no recurrent states), in one process (a tensor-parallel rank's
shard would need its peers' forward). The pass runs
after weight quantisation and before the tuner measures the methods: the layers are still
their sources, on a KV pool of its own that is freed after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from servelm.config import KernelConfig
from servelm.layers import w8a8
from servelm.layers.linear_methods import W8A8_FORMS, WeightFormat
from servelm.tuning import _linear_layers

logger = logging.getLogger(__name__)

# The layers calibrated (by attribute name), each with the longest activation block its rows
# are quantised in: attention's fused qkv and output projections and the MLP's fused gate_up
# and down projections. down_proj, whose inputs (after the gate) keep the widest outliers, in
# blocks of at most 64, and of at most 32 where its weights are quantised (QUANTISED_LONGEST):
# an int4 / int8 source's int8 copy rounds its codes a second time, which in blocks of 64 left
# Gemma-3-270M's int4 just under the accuracy bar, and in blocks of 32 reads as q8act's
# (docs/kernels.md, "w8a8"); the tuner then takes it only where it measures faster than q8act.
TARGETS = {"qkv_proj": 128, "o_proj": 128, "gate_up_proj": 128, "down_proj": 64}
QUANTISED_LONGEST = {"down_proj": 32}
TEXT = Path(__file__).with_name("calibration.txt")
TOKENS = 512  # the calibration text's first tokens
BLOCK = 16


def calibration_ids(tokenizer, tokens: int = TOKENS) -> list[int]:
    """The calibration text's first `tokens` token ids under the model's tokenizer."""
    return list(tokenizer.encode(TEXT.read_text(encoding="utf-8")))[:tokens]


def _targets(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: layer} of the linear layers calibrated (the tuner's sources named in
    TARGETS)."""
    return {qname: src for qname, _, name, src in _linear_layers(model) if name in TARGETS}


def _longest(qname: str, src: nn.Module) -> int:
    """The longest activation block of the target layer named qname, source src."""
    name = qname.rsplit(".", 1)[-1]
    if WeightFormat.of(src).quantised and name in QUANTISED_LONGEST:
        return QUANTISED_LONGEST[name]
    return TARGETS[name]


def wanted(model: nn.Module, setting: str, device: torch.device, kernels: KernelConfig) -> bool:
    """Whether this model is calibrated (int8_activations `setting`: auto or off): on the
    CPU for the tuner's w8a8 method (servelm.tuning), on CUDA for its Triton form
    (servelm.tuning_cuda)."""
    if setting == "off" or model.config.has_recurrent_state:
        return False
    # The method can never run: nothing measured (tuning off), or a forced list without it.
    if kernels.linear_method == "auto":
        if kernels.tuning == "off":
            return False
    elif not set(W8A8_FORMS) & set(kernels.linear_method.split(",")):
        return False
    p = next(model.parameters(), None)
    if p is None:
        return False
    if device.type == "cuda":
        runs = w8a8.triton_runs(p.dtype, device)
    else:  # the CPU kernel runs bf16 activations only
        runs = (device.type == "cpu" and kernels.cpu_kernels and p.dtype == torch.bfloat16
                and w8a8.int8_dot() and w8a8.available())
    return runs and any(w8a8.block_size(t.in_features) for t in _targets(model).values())


VERSION = 1  # of what a cached calibration holds and how it was measured


def cache_file(directory: Path, checkpoint: str, dtype: torch.dtype, quantization: str | None,
               token_ids: list[int]) -> Path:
    """Where a model's calibration is kept: named by the checkpoint (its path, and each
    file's size and modification time), the weights' format and dtype, and the tokens."""
    p = Path(checkpoint)
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    key = json.dumps([VERSION, str(p.resolve()), stats, str(dtype), quantization, TARGETS,
                      QUANTISED_LONGEST, hashlib.sha256(str(token_ids).encode()).hexdigest()])
    return directory / f"calibration-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _load(model: nn.Module, path: Path) -> int:
    """The calibration cached at path set on the model's target layers (the ones its pass
    reached); 0 where there is none or it does not fit them."""
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # none yet, or unreadable: measure
        return 0
    layers = _targets(model)
    if not saved or not set(saved) <= set(layers) or any(
            saved[n].shape != (layers[n].in_features,) for n in saved):
        return 0
    for n, amax in saved.items():
        w8a8.set_calibration(layers[n], amax.float().contiguous(), _longest(n, layers[n]))
    return len(saved)


def _save(model: nn.Module, path: Path) -> None:
    saved = {n: w8a8.calibrated(m) for n, m in _targets(model).items()
             if w8a8.calibrated(m) is not None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(saved, tmp)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again next start
        logger.warning("could not cache the int8-activation calibration in %s: %s", path, e)


@torch.no_grad()
def calibrate(model: nn.Module, token_ids: list[int], kernels: KernelConfig,
              cache: Path | None = None) -> int:
    """Sets each target layer's w8a8.AMAX (max |x| per input channel over token_ids, at most
    the model's positions of them, run through the model once), read back from `cache` where
    it holds them, else measured and written there; returns how many layers were
    calibrated."""
    token_ids = list(token_ids)[:getattr(model, "max_positions", len(token_ids))]
    if not token_ids:
        return 0
    if cache is not None and (done := _load(model, cache)):
        return done
    done = _measure(model, token_ids, kernels)
    if cache is not None and done:
        _save(model, cache)
    return done


def _measure(model: nn.Module, token_ids: list[int], kernels: KernelConfig) -> int:
    from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput

    t0 = time.perf_counter()
    named = _targets(model)
    targets = list(named.values())
    seen: dict[int, torch.Tensor] = {}

    def record(mod: nn.Module, args) -> None:
        x = args[0].detach()
        m = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        prev = seen.get(id(mod))
        seen[id(mod)] = m if prev is None else torch.maximum(prev, m)

    hooks = [t.register_forward_pre_hook(record) for t in targets]
    p = next(model.parameters())
    blocks = -(-len(token_ids) // BLOCK)
    try:
        kv = KVCache(model.config, blocks, BLOCK, p.dtype, p.device, hugepages=False)
        runner = ModelRunner(model, kv, p.device,
                             kernels=dataclasses.replace(kernels, fused_decode=False))
        # Every position's final hidden state (a pooling pass: no LM head), so the last
        # layer's o_proj and MLP see every row, not the sampled one's alone.
        runner.execute_pooling([SeqInput(list(token_ids), 0, list(range(blocks)),
                                         all_logits=True, pooling=True)])
    finally:
        for h in hooks:
            h.remove()
    done = 0
    for n, t in named.items():
        amax = seen.get(id(t))
        if amax is not None and amax.shape[0] == t.in_features and torch.isfinite(amax).all():
            w8a8.set_calibration(t, amax.contiguous(), _longest(n, t))
            done += 1
    logger.info("int8 activations: %d layers calibrated on %d tokens in %.2f s", done,
                len(token_ids), time.perf_counter() - t0)
    return done
