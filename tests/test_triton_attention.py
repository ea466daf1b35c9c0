"""The CUDA attention kernels in Triton (servelm/kernels/triton_attention.py: decode and
prompt chunks, in place over block tables) against PyTorch references, and the model
paths that take them.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1); with one, the same tests run them compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.attention import get_backend
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput, build_forward_batch
from servelm.kernels import triton_attention as ta
from servelm.models.layers import paged_decode_attention_ref
from tests.test_cuda_graphs import BS, _model, _Seqs

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _case(B, H, KVH, D, page, lens, dtype, table_dtype=torch.int32, seed=0):
    """Scattered blocks; every table entry past a row's length is an index far outside the
    pool, so a read of one would fault (CUDA) or raise (interpreter)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // page) for n in lens) + 3
    k = torch.randn(nb, page, KVH, D, generator=g).to(dtype)
    v = torch.randn(nb, page, KVH, D, generator=g).to(dtype)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    free = torch.randperm(nb, generator=g).tolist()
    W = max(-(-n // page) for n in lens) + 2
    tables = torch.full((B, W), 1 << 30, dtype=table_dtype)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            tables[b, j] = free.pop()
    cl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (q, k, v, tables, cl)]


_SHAPES = [(9, 3, 64, 16),    # SmolLM2: G = 3 (padded to 16)
           (8, 8, 32, 4),     # no grouping
           (32, 8, 128, 16),  # Llama-3-8B: G = 4
           (4, 1, 16, 1)]     # one-token blocks, G = 4
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_SPLITS = [None, 1, 3]
# On a GPU every combination; in Triton's interpreter (no GPU) every shape and split count in
# fp32 and each half dtype on the SmolLM2 shape: the dtype only changes loads and the store.
_DECODE_CASES = ([(d, *s, k) for d in _DTYPES for s in _SHAPES for k in _SPLITS]
                 if torch.cuda.is_available() else
                 [(torch.float32, *s, k) for s in _SHAPES for k in _SPLITS]
                 + [(d, *_SHAPES[0], k) for d in _DTYPES[1:] for k in (None, 3)])


@pytest.mark.parametrize("dtype,H,KVH,D,page,splits", _DECODE_CASES)
def test_decode_attention_matches_the_reference(dtype, H, KVH, D, page, splits):
    """Ragged lengths (1 key, block boundaries, several BLOCK_N steps); splits that
    cover a row, split it, or fall past its end (empty, merged with weight zero)."""
    lens = [1, 17, 300, page * 3, 65]
    q, k, v, tables, cl = _case(len(lens), H, KVH, D, page, lens, dtype)
    out = ta.paged_decode_attention(q, k, v, tables, cl, D ** -0.5, splits=splits)
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, cl, D ** -0.5)
    assert out.shape == (len(lens), H * D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.view(len(lens), -1), rtol=TOL[dtype],
                               atol=TOL[dtype])


def test_decode_attention_takes_long_tables_and_scale():
    q, k, v, tables, cl = _case(3, 6, 2, 32, 8, [40, 8, 129], torch.float32, torch.int64)
    out = ta.paged_decode_attention(q, k, v, tables, cl, 0.3, splits=2)
    ref = paged_decode_attention_ref(q, k, v, tables, cl, 0.3)
    torch.testing.assert_close(out, ref.view(3, -1), rtol=2e-5, atol=2e-5)
    # A row attends to its first context_lens keys: one fewer changes that row only.
    cl2 = cl.clone()
    cl2[1] = 7
    out2 = ta.paged_decode_attention(q, k, v, tables, cl2, 0.3, splits=2)
    assert torch.equal(out2[0], out[0]) and torch.equal(out2[2], out[2])
    assert not torch.allclose(out2[1], out[1])


def test_decode_attention_rejects_mismatched_shapes_and_takes_empty_batches():
    q, k, v, tables, cl = _case(2, 8, 2, 32, 4, [5, 9], torch.float32)
    with pytest.raises(ValueError, match="does not match the cache"):
        ta.paged_decode_attention(q[..., :16].contiguous(), k, v, tables, cl, 1.0)
    with pytest.raises(ValueError, match="does not match the cache"):
        ta.paged_decode_attention(q[:, :7].contiguous(), k, v, tables, cl, 1.0)
    with pytest.raises(ValueError, match="contiguous last"):
        ta.paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                                  tables, cl, 1.0)
    empty = ta.paged_decode_attention(q[:0], k, v, tables[:0], cl[:0], 1.0)
    assert empty.shape == (0, 8 * 32)


def _prefill_ref(q, k, v, tables, cu, start, scale):
    """Each query token attends to keys 0..its position, one SDPA call per token."""
    T, H, D = q.shape
    page, kvh = k.shape[1], k.shape[2]
    out = torch.empty(T, H, D)
    for b in range(len(start)):
        for t in range(int(cu[b]), int(cu[b + 1])):
            n = int(start[b]) + t - int(cu[b]) + 1
            blocks = tables[b, :-(-n // page)].long()
            kk, vv = (x[blocks].reshape(-1, kvh, D)[:n].float().repeat_interleave(H // kvh, 1)
                      .transpose(0, 1) for x in (k, v))
            out[t] = F.scaled_dot_product_attention(q[t].float().unsqueeze(1), kk, vv,
                                                    scale=scale).squeeze(1)
    return out.view(T, H * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KVH,D,page", [(9, 3, 64, 16),   # G = 3: 21 tokens a 64-row tile
                                          (4, 4, 16, 4),    # G = 1: 64 tokens a tile
                                          (8, 2, 32, 1)])   # one-token blocks
def test_prefill_attention_matches_the_reference(dtype, H, KVH, D, page):
    """Ragged prompt chunks in one call: a whole prompt, one token after a context, a
    chunk that continues at position 90 (keys before it, its own causal), one that spans
    several query tiles; table entries past each row's keys are never read."""
    qlens, starts = [5, 1, 70, 23], [0, 30, 90, 0]
    lens = [s + n for s, n in zip(starts, qlens)]
    _, k, v, tables, _ = _case(len(lens), H, KVH, D, page, lens, dtype, seed=1)
    q = torch.randn(sum(qlens), H, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    start = torch.tensor(starts, dtype=torch.int32, device=DEV)
    out = ta.paged_prefill_attention(q, k, v, tables, cu, start, max(qlens), D ** -0.5)
    ref = _prefill_ref(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), cu.cpu(), start.cpu(), D ** -0.5)
    assert out.shape == (sum(qlens), H * D) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_prefill_attention_rejects_mismatched_shapes_and_takes_empty_batches():
    _, k, v, tables, _ = _case(1, 4, 2, 16, 4, [8], torch.float32)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEV)
    start = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="does not match the cache"):
        ta.paged_prefill_attention(torch.randn(8, 4, 8, device=DEV), k, v, tables, cu, start, 8,
                                   1.0)
    empty = ta.paged_prefill_attention(torch.randn(0, 4, 16, device=DEV), k, v, tables[:0],
                                       cu[:1], start[:0], 0, 1.0)
    assert empty.shape == (0, 64)


def test_split_counts_depend_on_batch_and_width_only():
    cpu = torch.device("cpu")
    for batch, kvh, keys in [(1, 8, 512), (64, 8, 512), (1, 1, 100_000), (3, 3, 1), (7, 2, 4096)]:
        splits, per = ta.num_splits(batch, kvh, keys, cpu)
        assert 1 <= splits <= ta.MAX_SPLITS and per % ta.BLOCK_N == 0
        assert (splits - 1) * per < keys <= splits * per  # every split but the last non-empty
    # One row fills the (interpreter's 4) SMs twice: 8 programs over 8 KV heads, then split.
    assert ta.num_splits(1, 1, 4096, cpu)[0] == 8
    assert ta.num_splits(64, 8, 1024, cpu)[0] == 1
    # Long contexts are split anyway (about 2,048 keys a split at most, up to MAX_SPLITS),
    # so one long row among short ones is not one program's serial walk.
    assert ta.num_splits(64, 8, 8192, cpu)[0] == 4
    assert ta.num_splits(64, 8, 1 << 20, cpu)[0] == ta.MAX_SPLITS
    assert ta.num_splits(1, 1, 64, cpu) == (1, 64)  # never below one BLOCK_N a split
    assert ta.num_splits(1, 1, 4096, cpu, want=3) == (3, 1408)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
def test_the_probe_passes_right_kernels_and_refuses_wrong_or_failing_ones(dtype, page,
                                                                          monkeypatch, caplog):
    """ModelRunner takes the Triton path only if both kernels compile for the model's
    shape and agree with the references on a small case; otherwise it logs and gathers."""
    ta._works.clear()
    assert ta.works(DEV, dtype, 8, 2, 32, page)
    assert (str(DEV), dtype, 8, 2, 32, page) in ta._works
    real, real_decode = ta.paged_prefill_attention, ta.paged_decode_attention
    try:
        ta._works.clear()
        monkeypatch.setattr(ta, "paged_prefill_attention", lambda *a: real(*a) * 1.1)
        assert not ta.works(DEV, dtype, 8, 2, 32, page)
        assert "prompt kernel disagrees" in caplog.text
        monkeypatch.setattr(ta, "paged_prefill_attention", real)
        ta._works.clear()

        def wrong_merge(*a, splits=None):  # only the split path (stage 2) is wrong
            return real_decode(*a, splits=splits) * (1.1 if splits == 2 else 1.0)

        monkeypatch.setattr(ta, "paged_decode_attention", wrong_merge)
        assert not ta.works(DEV, dtype, 8, 2, 32, page)
        assert "decode kernel (2 split) disagrees" in caplog.text
        ta._works.clear()

        def fails(*a, **k):
            raise ValueError("no such kernel here")

        monkeypatch.setattr(ta, "paged_decode_attention", fails)
        assert not ta.works(DEV, dtype, 8, 2, 32, page)
        assert "no such kernel here" in caplog.text
    finally:
        ta._works.clear()


def test_the_probe_compiles_the_variants_a_model_needs(monkeypatch, caplog):
    """A model with a soft-cap, sinks or chunks: the probe also runs those kernel variants
    (each a compile of its own) and refuses them where they give non-finite outputs."""
    ta._works.clear()
    options = frozenset({"softcap", "sinks", "chunk"})
    try:
        assert ta.works(DEV, torch.float32, 8, 2, 32, 16, options=options)
        assert (str(DEV), torch.float32, 8, 2, 32, 16, "chunk", "sinks", "softcap") in ta._works
        real = ta.paged_decode_attention

        def nan_when_capped(*a, softcap=None, **k):
            out = real(*a, softcap=softcap, **k)
            return out * float("nan") if softcap else out

        monkeypatch.setattr(ta, "paged_decode_attention", nan_when_capped)
        ta._works.clear()
        assert ta.works(DEV, torch.float32, 8, 2, 32, 16)  # without the option: not run
        assert not ta.works(DEV, torch.float32, 8, 2, 32, 16, options=options)
        assert "non-finite outputs" in caplog.text
    finally:
        ta._works.clear()


def test_triton_can_be_turned_off(monkeypatch):
    """KernelConfig.triton_attention off: the runner keeps gather + SDPA even where the
    Triton kernels pass their probe."""
    from servelm.config import KernelConfig

    monkeypatch.setattr(ta, "works", lambda *a: True)
    model = _model("cpu")
    kv = KVCache(model.config, 8, BS, torch.float32, torch.device("cpu"))
    # Building a runner touches no device memory: the CUDA decision is made without a GPU.
    dev = torch.device("cuda")
    assert ModelRunner(model, kv, dev).attention.name == "triton"
    off = ModelRunner(model, kv, dev, kernels=KernelConfig(triton_attention=False))
    assert off.attention.name == "reference"


def test_runner_attends_in_place_through_triton():
    """The eager model (what CUDA runs without graphs) with triton_attention: decodes of
    very different lengths form one group, prompt chunks (a whole prompt, and one that
    continues a context) another, none padded to the longest; the logits equal the
    gather + SDPA path's."""
    model = _model(DEV.type)
    kv = KVCache(model.config, 128, BS, torch.float32, DEV)
    runner = ModelRunner(model, kv, DEV)
    assert (runner.attention.name == "triton") == (DEV.type == "cuda")
    runner.use_kernels, runner.attention = False, get_backend("reference")
    seqs = _Seqs([3, 150, 9, 40, 5, 30], kv.num_blocks)
    runner.execute([seqs.prompt(i) for i in range(4)])
    runner.execute([SeqInput(seqs.tokens[5][:20], 0, seqs.table(5, 20), False)])
    step = ([seqs.decode(i, 7 + i) for i in range(4)] + [seqs.prompt(4)]
            + [SeqInput(seqs.tokens[5][20:], 20, seqs.table(5, 30))])
    batch, _ = build_forward_batch(step, BS, 2, DEV, "triton")
    assert batch.attn.backend.name == "triton"
    assert [g.end - g.start for g in batch.attn.groups] == [4, 15]
    saved = kv.data.clone()
    runner.attention = get_backend("triton")
    got, got_rows = runner.execute(step)
    kv.data.copy_(saved)
    runner.attention = get_backend("reference")
    want, want_rows = runner.execute(step)
    assert sorted(got_rows) == sorted(want_rows) == [0, 1, 2, 3, 4, 5]
    order = lambda rows: sorted(range(len(rows)), key=rows.__getitem__)  # noqa: E731
    torch.testing.assert_close(got[order(got_rows)], want[order(want_rows)], rtol=1e-4,
                               atol=1e-4)
