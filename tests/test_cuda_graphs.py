"""Captured decode steps (servelm.engine.cuda_graphs) against the eager model runner.

The padded static-buffer forward runs on the CPU too (capture=False), so everything but the
capture itself is checked here on every machine; on a machine with CUDA the same checks run
with real graphs, in fp32 (results within rounding of the eager path's) and bf16.
"""

from __future__ import annotations

import pytest
import torch

from servelm.attention import get_backend
from servelm.cli import add_engine_args, build_llm  # noqa: F401  (the flag's contract)
from servelm.config import EngineConfig
from servelm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, table_width
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput
from servelm.models.config import ModelConfig
from servelm.models.llama import LlamaForCausalLM

BS = 4  # small blocks: contexts cross block and table-width boundaries within a few steps
CUDA = torch.cuda.is_available()
DEVICES = [("cpu", False)] + ([("cuda", True)] if CUDA else [])


def _model(device, dtype=torch.float32, seed=0, max_positions=256):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, max_positions=max_positions)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return model.to(device=device, dtype=dtype).eval()


def _setup(device, capture, dtype=torch.float32, max_batch=8, num_blocks=64,
           triton_attention=False):
    model = _model(device, dtype)
    kv = KVCache(model.config, num_blocks, BS, dtype, torch.device(device), spare_block=True)
    eager = ModelRunner(model, kv, torch.device(device))
    # The eager PyTorch reference (gather + SDPA attention), what CUDA runs without graphs
    # or Triton.
    eager.use_kernels, eager.attention = False, get_backend("reference")
    graphs = DecodeGraphs(model, kv, torch.device(device), max_batch=max_batch, capture=capture,
                          attention=get_backend("triton" if triton_attention else "reference"))
    return model, kv, eager, graphs


class _Seqs:
    """Sequences with scattered blocks of one pool (block i of each owned by nobody else)."""

    def __init__(self, lens, num_blocks, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = [[] for _ in lens]
        self.tokens = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lens]

    def table(self, i, length):
        while len(self.tables[i]) * BS < length:
            self.tables[i].append(self.free.pop())
        return list(self.tables[i])

    def prompt(self, i):
        n = len(self.tokens[i])
        return SeqInput(self.tokens[i], 0, self.table(i, n))

    def decode(self, i, token, sample=True):
        p = len(self.tokens[i])
        self.tokens[i].append(token)
        return SeqInput([token], p, self.table(i, p + 1), sample)


def test_graph_batch_sizes_pad_at_most_one_and_a_half_times():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(100)[-2:] == [96, 100]
    assert graph_batch_sizes(1) == [1]
    for m in (3, 64, 256):
        s = graph_batch_sizes(m)
        assert s[-1] == m and all(b / a <= 2 for a, b in zip(s, s[1:]))
        assert all(b / a <= 1.5 for a, b in zip(s, s[1:]) if a >= 8)


def test_table_widths_pad_at_most_a_quarter_with_four_per_doubling():
    assert [table_width(n) for n in range(1, 10)] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert [table_width(n) for n in (17, 33, 64, 65, 500)] == [20, 40, 64, 80, 512]
    widths = {table_width(n) for n in range(1, 4097)}
    for n in range(1, 4097):
        assert n <= table_width(n) <= 1.25 * n
    for k in range(3, 12):  # four widths in each (2^k, 2^(k+1)]
        assert len([w for w in widths if 2 ** k < w <= 2 ** (k + 1)]) == 4


# Triton runs CPU tensors only in its interpreter, which conftest turns on where no GPU is.
TRITON_DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("triton_attention", [False, True])
@pytest.mark.parametrize("device,capture", DEVICES)
def test_decode_steps_match_the_eager_runner(device, capture, triton_attention):
    """Batches that shrink and grow (padding rows), contexts that cross block and
    table-width boundaries, and a row that does not sample: the logits equal
    the eager runner's, step after step (every step's K/V is then right too); with the
    graphs' attention as the eager path's gather + SDPA, or the Triton decode kernel
    (in Triton's interpreter without a GPU)."""
    if triton_attention and device != TRITON_DEVICE:
        pytest.skip("Triton takes CUDA tensors where a GPU is (compiled, not interpreted)")
    model, kv, eager, graphs = _setup(device, capture, triton_attention=triton_attention)
    seqs = _Seqs([3, 9, 1, 14, 6], kv.num_blocks)
    with torch.inference_mode():
        eager.execute([seqs.prompt(i) for i in range(5)])
    active = [0, 1, 2, 3, 4]
    schedule = [active] * 4 + [[0, 2, 4]] * 5 + [[1]] * 3 + [[0, 1, 2, 3, 4]] * 6
    for step, rows in enumerate(schedule):
        tokens = [(7 * step + 3 * i) % 96 for i in rows]
        batch = [seqs.decode(i, t, sample=not (step == 5 and i == 2))
                 for i, t in zip(rows, tokens)]
        saved = kv.data.clone()
        got, got_rows = graphs.execute(batch)
        after_graph = kv.data.clone()
        kv.data.copy_(saved)
        want, want_rows = eager.execute(batch)
        want = want[sorted(range(len(want_rows)), key=want_rows.__getitem__)]  # input order
        assert got_rows == sorted(want_rows) == [j for j, s in enumerate(batch) if s.sample]
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # The same K/V in every block a sequence owns; padding rows wrote only the spare.
        torch.testing.assert_close(after_graph[:, :, :kv.num_blocks], kv.data[:, :, :kv.num_blocks],
                                   rtol=1e-5, atol=1e-5)
    # One graph (or static forward) per (padded batch, table width) seen, reused after.
    keys = set(graphs._graphs)
    assert {b for b, _ in keys} == {1, 4, 8}  # 1, 3 and 5 rows, padded
    assert {w for _, w in keys} == {3, 4, 5, 6}  # blocks the longest row needs, step by step
    if capture:
        assert graphs.num_captured == len(keys)


@pytest.mark.parametrize("device,capture", DEVICES)
def test_steps_a_graph_does_not_run_are_left_to_the_eager_path(device, capture):
    model, kv, eager, graphs = _setup(device, capture, max_batch=2)
    seqs = _Seqs([5, 5, 5], kv.num_blocks)
    assert graphs.execute([seqs.prompt(0)]) is None  # a prompt chunk
    with torch.inference_mode():
        eager.execute([seqs.prompt(1), seqs.prompt(2)])
    assert graphs.execute([seqs.decode(i, 1) for i in (0, 1, 2)]) is None  # over max_batch
    assert not graphs._graphs


def test_a_long_context_among_short_ones_is_left_to_the_eager_path():
    """Padding every table to the longest would read far more keys than the rows attend
    to: such a step runs eagerly (which groups rows by length); a similar one with
    comparable lengths replays. With the Triton decode attention, which reads only each
    row's own keys, the padded step replays too, and gives the eager path's logits."""
    model, kv, eager, graphs = _setup(TRITON_DEVICE, False, max_batch=16, num_blocks=256)
    ragged = DecodeGraphs(model, kv, torch.device(TRITON_DEVICE), max_batch=16, capture=False,
                          attention=get_backend("triton"))
    seqs = _Seqs([2] * 15 + [200], kv.num_blocks)
    with torch.inference_mode():
        eager.execute([seqs.prompt(i) for i in range(16)])
    step = [seqs.decode(i, 3) for i in range(16)]
    assert graphs.execute(step) is None
    got, rows = ragged.execute(step)
    with torch.inference_mode():
        want, want_rows = eager.execute(step)
    assert rows == list(range(16))
    want = want[sorted(range(16), key=want_rows.__getitem__)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs.execute([seqs.decode(i, 3) for i in range(15)]) is not None


def test_a_runner_with_graphs_takes_them_for_decodes_only():
    """ModelRunner(cuda_graphs=True) routes decode steps through DecodeGraphs (here on
    the CPU without capturing) and prompt steps through the eager model."""
    model = _model("cpu")
    kv = KVCache(model.config, 32, BS, torch.float32, torch.device("cpu"), spare_block=True)
    with pytest.raises(ValueError, match="CUDA device"):
        ModelRunner(model, kv, torch.device("cpu"), cuda_graphs=True)
    calls = []

    class Recording(DecodeGraphs):
        def execute(self, seqs):
            out = super().execute(seqs)
            calls.append(out is not None)
            return out

    runner = ModelRunner(model, kv, torch.device("cpu"))
    runner.use_kernels, runner.attention = False, get_backend("reference")
    runner.graphs = Recording(model, kv, torch.device("cpu"), max_batch=4, capture=False)
    seqs = _Seqs([6, 2], kv.num_blocks)
    runner.execute([seqs.prompt(0), seqs.prompt(1)])
    logits, rows = runner.execute([seqs.decode(0, 5), seqs.decode(1, 6)])
    assert calls == [False, True] and rows == [0, 1] and logits.shape == (2, 96)


def test_graphs_need_a_spare_block():
    model = _model("cpu")
    kv = KVCache(model.config, 8, BS, torch.float32, torch.device("cpu"))
    assert kv.pad_block is None and kv.data.shape[2] == 8
    with pytest.raises(ValueError, match="spare block"):
        DecodeGraphs(model, kv, torch.device("cpu"), capture=False)
    spare = KVCache(model.config, 8, BS, torch.float32, torch.device("cpu"), spare_block=True)
    assert spare.pad_block == 8 and spare.data.shape[2] == 9 and spare.num_blocks == 8


def test_enforce_eager_is_an_engine_flag():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).enforce_eager is False
    assert p.parse_args(["--enforce-eager"]).enforce_eager is True
    assert EngineConfig(enforce_eager=True).enforce_eager
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'yes'"):
        EngineConfig(enforce_eager="yes")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bf16_graphs_on_cuda_track_the_eager_path():
    """bf16 on the GPU: the captured steps' greedy tokens follow the eager path's over a
    longer run, and their logits stay within bf16 rounding."""
    model, kv, eager, graphs = _setup("cuda", True, dtype=torch.bfloat16, max_batch=16,
                                      num_blocks=256)
    seqs = _Seqs([5, 17, 30, 2, 11, 8], kv.num_blocks, seed=3)
    with torch.inference_mode():
        eager.execute([seqs.prompt(i) for i in range(6)])
    nxt = [1] * 6
    for step in range(40):
        batch = [seqs.decode(i, nxt[i]) for i in range(6)]
        saved = kv.data.clone()
        got, _ = graphs.execute(batch)
        kv.data.copy_(saved)
        want, rows = eager.execute(batch)
        want = want[sorted(range(len(rows)), key=rows.__getitem__)]
        assert (got - want).abs().max() <= 0.03 * want.abs().max()  # bf16 rounding
        nxt = want.argmax(-1).tolist()
    assert graphs.num_captured >= 2
