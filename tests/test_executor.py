"""The engine's executor (servelm.engine.executor): the one seam between the engine and the
model, its KV sizing, the tensor-parallel executor implementing the same interface, the
import layering around it, and the process-wide start-up (servelm.runtime)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest
import torch

from helpers import release, runner_path, run_seqs
from servelm.engine.executor import (DEFAULT_CPU_KV_BYTES, Executor, UniProcExecutor,
                                     default_kv_bytes, pool_blocks)
from servelm.engine.model_runner import KVCache, SeqInput

SERVELM = Path(__file__).resolve().parent.parent / "servelm"


def test_engine_holds_an_executor_and_nothing_else_of_the_model(llm):
    engine = llm.engine
    assert isinstance(engine.executor, UniProcExecutor)
    assert isinstance(engine.executor, Executor)
    for name in ("model", "runner", "kv_cache", "tuning"):
        assert name not in vars(engine), name
    ex = engine.executor
    assert ex.runner.model is ex.model and ex.runner.kv_cache is ex.kv_cache
    assert ex.model.config.vocab_size == engine.model_config.vocab_size
    assert ex.tuning is not None and ex.draft is None


def test_kv_pool_sized_from_kv_cache_memory(llm):
    engine, ex = llm.engine, llm.engine.executor
    cache = engine.config.cache
    block = KVCache.bytes_per_block(engine.model_config, cache.block_size, engine.kv_dtype)
    assert ex.block_bytes == block
    assert ex.num_blocks == cache.kv_cache_memory // block == ex.kv_cache.num_blocks
    assert engine.block_manager.num_blocks == ex.num_blocks
    assert engine.kv_capacity_tokens == ex.num_blocks * cache.block_size
    assert ex.kv_cache.data.dtype == engine.kv_dtype


def test_pool_blocks_and_default_budget():
    assert pool_blocks(1000, 300) == 3
    with pytest.raises(ValueError, match=r"kv_cache_memory of 100 bytes holds no block "
                                         r"\(one block takes 300 bytes on a rank\)"):
        pool_blocks(100, 300, " on a rank")
    assert 64 << 20 <= default_kv_bytes(torch.device("cpu")) <= DEFAULT_CPU_KV_BYTES


def test_execute_is_the_runners_step_and_matches_the_reference(llm):
    """A small mixed batch through the executor: the logits its runner gives (it is the
    runner's step, nothing added), close to the eager fp32 reference path's."""
    engine = llm.engine
    a = engine.tokenizer.encode("The capital of France is")
    b = engine.tokenizer.encode("1, 2, 3, 5, 8,")
    try:
        got = run_seqs(engine, [(a, 0, "xa"), (b, 0, "xb")])
        assert got.shape == (2, engine.model_config.vocab_size) and got.dtype == torch.float32
        bm = engine.block_manager
        again, rows = engine.executor.runner.execute(
            [SeqInput(a, 0, bm.block_table("xa")), SeqInput(b, 0, bm.block_table("xb"))])
        order = sorted(range(len(rows)), key=lambda r: rows[r])
        torch.testing.assert_close(again[order], got, rtol=0, atol=0)
        with runner_path(engine.executor.runner, kernels=False):
            ref = run_seqs(engine, [(a, 0, "ra"), (b, 0, "rb")])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-3)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    finally:
        for owner in ("xa", "xb", "ra", "rb"):
            release(engine, owner)


def test_shutdown_and_health_are_idempotent(llm):
    ex = llm.engine.executor
    for _ in range(2):
        assert ex.check_health() is None
        ex.shutdown()
        llm.engine.shutdown()
    # One process: nothing was released that a step needs.
    assert llm.generate("Hi", use_tqdm=False)[0].outputs[0].token_ids


def test_tensor_parallel_executor_implements_the_interface():
    from servelm.distributed.executor import TPExecutor

    assert issubclass(TPExecutor, Executor)
    assert not TPExecutor.__abstractmethods__
    assert not UniProcExecutor.__abstractmethods__


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports in functions included)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(SERVELM.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_layering_distributed_never_imports_the_engine():
    """distributed builds on engine.executor; only the engine imports distributed (lazily),
    so neither engine.engine nor engine.executor is on an import cycle through it."""
    for path in sorted((SERVELM / "distributed").glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith("servelm.engine.engine")}
        assert not bad, f"{path.name} imports {bad}"
    for name in ("executor.py", "model_runner.py"):
        bad = {m for m in _imports(SERVELM / "engine" / name)
               if m.startswith(("servelm.distributed", "servelm.engine.engine"))}
        assert not bad, f"engine/{name} imports {bad}"


def test_engine_constructor_sets_no_process_state():
    """Threads and gc.freeze are the process entry's (servelm.runtime), not the engine's."""
    src = (SERVELM / "engine" / "engine.py").read_text()
    calls = {n.func.attr for n in ast.walk(ast.parse(src))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"set_num_threads", "freeze"}


def test_runtime_start_up(monkeypatch):
    from servelm import kernels
    from servelm.runtime import finish_startup, init_process

    init_process()
    init_process()  # idempotent
    disabled, loaded = kernels.prepare(), kernels.load_ops("ops")
    # Read once: a later change of the environment reaches neither prepare nor load_ops.
    monkeypatch.setenv("SERVELM_NO_KERNELS", "0" if disabled else "1")
    assert kernels.prepare() is disabled and kernels.load_ops("ops") is loaded
    try:
        finish_startup()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
