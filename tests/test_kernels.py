"""C++ CPU kernels (servelm/kernels/csrc/ops.cpp) against their PyTorch references, and the
engine with kernels against the eager reference path (greedy tokens identical in fp32)."""

from __future__ import annotations

import pytest
import torch

from servelm.attention.cpu import paged_prefill_attention
from servelm.attention.metadata import build_group
from servelm.attention.reference import paged_attention
from servelm.engine.model_runner import SeqInput, build_forward_batch
from servelm.kernels import load_ops
from servelm.models.layers import (fused_add_layer_norm_ref, fused_add_rms_norm_ref,
                                   layer_norm_ref, paged_decode_attention_ref, rms_norm_ref,
                                   rotary_kv_write_ref, silu_and_mul_ref)
from tests.helpers import runner_path

pytestmark = pytest.mark.skipif(not load_ops("ops"), reason="servelm C++ kernels unavailable")

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}
LENS = [1, 15, 16, 17, 1000]


def ops():
    return torch.ops.servelm_ops


def _paged_setup(lens, kvh, g, d, bs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, not contiguous
    max_blocks = max(need) + 1                                 # wider than any row needs
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
    q = torch.randn(len(lens), kvh * g, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1, 3])
# [150]: one sequence of 64..255 tokens is split into one part per thread.
@pytest.mark.parametrize("lens", [LENS, [1000], [17], [150], [300, 5]])
def test_paged_decode_attention_matches_reference(dtype, g, lens):
    q, kc, vc, tables, cl = _paged_setup(lens, kvh=3, g=g, d=64, bs=16, dtype=dtype)
    scale = 64 ** -0.5
    got = ops().paged_decode_attention(q, kc, vc, tables, cl, scale)
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, cl, scale)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 100, 512])
# Short rows inside the window, rows longer than it, and [150]/[1000]: split contexts whose
# early splits fall wholly before the window.
@pytest.mark.parametrize("lens", [[5, 40, 700, 16, 17], [150], [1000]])
def test_paged_decode_attention_sliding_window(dtype, window, lens):
    q, kc, vc, tables, cl = _paged_setup(lens, kvh=2, g=2, d=64, bs=16, dtype=dtype, seed=3)
    got = ops().paged_decode_attention(q, kc, vc, tables, cl, 0.125, window)
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, cl, 0.125,
                                      window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops().paged_decode_attention(q, kc, vc, tables, cl, 0.125, -1)


def test_paged_decode_attention_strided_q_and_other_head_dim():
    # q as a view into a wider row (as qkv[:, :q_size] is), head dim 128, block size 32.
    q, kc, vc, tables, cl = _paged_setup([5, 40, 700], kvh=2, g=4, d=128, bs=32,
                                         dtype=torch.float32, seed=1)
    wide = torch.randn(3, q.shape[1] * 128 + 100)
    wide[:, :q.shape[1] * 128] = q.reshape(3, -1)
    qv = wide[:, :q.shape[1] * 128].view(3, q.shape[1], 128)
    got = ops().paged_decode_attention(qv, kc, vc, tables, cl, 0.1)
    want = paged_decode_attention_ref(q, kc, vc, tables, cl, 0.1)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d", [(6, 64), (5, 64), (3, 128), (2, 32)])
def test_paged_decode_attention_head_groups_in_register_blocks(dtype, g, d):
    # P.V keeps up to 4 heads' accumulators in registers (fewer for wide heads): group sizes
    # that leave a remainder block (6 = 4 + 2, 5 = 4 + 1 at d=64; 3 = 2 + 1 at d=128).
    q, kc, vc, tables, cl = _paged_setup([1, 31, 33, 300], kvh=2, g=g, d=d, bs=16, dtype=dtype, seed=2)
    got = ops().paged_decode_attention(q, kc, vc, tables, cl, d ** -0.5)
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, cl, d ** -0.5)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kvh,d", [(1, 2), (3, 2), (1, 4)])
def test_paged_decode_attention_rows_of_a_few_bytes(dtype, kvh, d):
    # Each item first reads its K/V rows from every cache line they span (a word a line
    # where a row is a multiple of 8 bytes, else a byte): rows of 4 and 12 bytes take the
    # byte path, 8 the word path. (LENS's 1000 tokens span several read-ahead chunks.)
    q, kc, vc, tables, cl = _paged_setup([1, 40, 333], kvh=kvh, g=2, d=d, bs=16, dtype=dtype, seed=3)
    got = ops().paged_decode_attention(q, kc, vc, tables, cl, d ** -0.5)
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, cl, d ** -0.5)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 49152), (3, 5), (4, 16), (5, 63), (5, 64),
                                       (5, 65), (9, 1000)])
def test_argmax_rows_is_torch_argmax(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    for x in (torch.randn(rows, cols, generator=gen),
              torch.randint(-2, 3, (rows, cols), generator=gen).float()):  # many ties: first wins
        assert torch.equal(ops().argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(rows, cols + 7, generator=gen)[:, 3:3 + cols]  # rows with a stride
    assert torch.equal(ops().argmax_rows(wide), wide.argmax(dim=-1))


def test_argmax_rows_special_values_and_bad_arguments():
    x = torch.randn(6, 200)
    x[0, 150] = float("nan")            # NaN counts as the largest, as in torch
    x[1, 3], x[1, 170] = float("nan"), float("nan")
    x[2, 10], x[2, 90] = float("inf"), float("inf")
    x[3] = float("-inf")                # all -inf: index 0
    x[4] = 0.0
    x[4, 7] = -0.0                      # -0 == +0: the first
    x[5, 199] = 100.0                   # in the scalar tail
    assert ops().argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [150, 3, 10, 0, 0, 199]
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        ops().argmax_rows(x.bfloat16())
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        ops().argmax_rows(x[0])
    with pytest.raises(RuntimeError, match="rows must not be empty"):
        ops().argmax_rows(torch.empty(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_norms_and_silu_match_reference(dtype, rows):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(ops().rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **tol)
    r1, r2 = res.clone(), res.clone()
    y1 = ops().fused_add_rms_norm(x, r1, w, 1e-5)
    y2 = fused_add_rms_norm_ref(x, r2, w, 1e-5)
    assert torch.equal(r1, r2)  # the residual add rounds exactly as the eager add
    torch.testing.assert_close(y1, y2, **tol)
    gu = torch.randn(rows, 2 * 1536, generator=gen).to(dtype)
    torch.testing.assert_close(ops().silu_and_mul(gu), silu_and_mul_ref(gu), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norms_match_reference(dtype, bias):
    """LayerNorm on the C++ ops (the arithmetic the DecodeStack runs: the mean and variance
    in fp32 over the row), against PyTorch's, with a bias (StableLM) and without (Cohere);
    rows of a non-zero mean, where a one-pass variance would lose digits."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 576, generator=gen) * 3 + 20).to(dtype)
    res = torch.randn(5, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(576, generator=gen)).to(dtype) if bias else None
    tol = TOL[dtype]
    torch.testing.assert_close(ops().layer_norm(x, w, b, 1e-5), layer_norm_ref(x, w, b, 1e-5), **tol)
    r1, r2 = res.clone(), res.clone()
    y1 = ops().fused_add_layer_norm(x, r1, w, b, 1e-5)
    y2 = fused_add_layer_norm_ref(x, r2, w, b, 1e-5)
    assert torch.equal(r1, r2)  # the residual add rounds exactly as the eager add
    torch.testing.assert_close(y1, y2, **tol)
    with pytest.raises(RuntimeError, match="layer_norm: bias must be contiguous"):
        ops().layer_norm(x, w, w[:10], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_special_values(dtype):
    # The vector paths (8 or 16 lanes at a time, then a scalar tail): nan stays nan, +-inf
    # and large values as the eager ops give them, wherever they fall.
    gu = torch.randn(3, 2 * 77).to(dtype)
    for j, v in enumerate([float("nan"), float("inf"), 100.0, -100.0, 1e-30]):
        gu[0, 9 * j] = v  # vector lanes
        gu[1, 72 + j] = v  # the scalar tail (77 = 64 + 8 + 5)
    want = silu_and_mul_ref(gu)
    got = ops().silu_and_mul(gu)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    torch.testing.assert_close(got[keep], want[keep], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh", [(9, 3), (4, 4)])
def test_rotary_kv_write_matches_reference(dtype, h, kvh):
    gen = torch.Generator().manual_seed(3)
    T, d, nb, bs = 7, 64, 6, 16
    qkv = torch.randn(T, (h + 2 * kvh) * d, generator=gen).to(dtype)
    ang = torch.rand(T, d // 2, generator=gen) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    kc1, vc1 = torch.zeros(nb, bs, kvh, d, dtype=dtype), torch.zeros(nb, bs, kvh, d, dtype=dtype)
    kc2, vc2 = kc1.clone(), vc1.clone()
    q1, q2 = qkv.clone(), qkv.clone()
    ops().rotary_kv_write(q1, cos, sin, kc1, vc1, slots, h, kvh)
    rotary_kv_write_ref(q2, cos, sin, kc2, vc2, slots, h, kvh)
    tol = TOL[dtype]
    torch.testing.assert_close(q1, q2, **tol)
    torch.testing.assert_close(kc1, kc2, **tol)
    assert torch.equal(vc1, vc2)
    if dtype == torch.bfloat16:  # the AVX-512 path rounds each product as the reference does
        assert torch.equal(q1, q2) and torch.equal(kc1, kc2)
    bad = slots.clone()
    bad[2] = nb * bs  # one past the last slot
    with pytest.raises(RuntimeError, match=rf"rotary_kv_write: slot_mapping\[2\] = {nb * bs} "
                                            r"is outside the KV cache"):
        ops().rotary_kv_write(q1, cos, sin, kc1, vc1, bad, h, kvh)


def test_kernel_batch_puts_decodes_first_with_ragged_tables():
    bs = 16
    seqs = [SeqInput([8, 9, 10], 0, [300]),                  # a 3-token prompt
            SeqInput([5], 19, [0, 1]),                       # context 20
            SeqInput([6], 1999, list(range(10, 135))),       # context 2000
            SeqInput(list(range(20)), 16, [7, 8, 9], sample=False)]  # chunk, no logits
    batch, sampled = build_forward_batch(seqs, bs, 3, torch.device("cpu"), "cpu")
    dec = batch.attn.decodes
    assert batch.attn.backend.name == "cpu" and dec.num == 2
    assert dec.context_lens.tolist() == [20, 2000]
    assert dec.block_tables.dtype == torch.int32
    assert dec.block_tables.shape == (2, 125)
    assert dec.block_tables[0, :3].tolist() == [0, 1, 0]
    assert batch.input_ids.tolist()[:2] == [5, 6]
    assert batch.slot_mapping.tolist()[:2] == [1 * bs + 3, 134 * bs + 15]
    assert [(g.start, g.end) for g in batch.attn.groups] == [(2, 5), (5, 25)]
    assert sampled == [1, 2, 0] and batch.logits_indices.tolist() == [0, 1, 4]


# ---- end to end: kernels vs the eager reference on the same engine ------------------------------

def _greedy(llm, prompts, n):
    from servelm import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def _runner(llm):
    return llm.engine.executor.runner


def test_fp32_engine_with_kernels_matches_eager_greedy(llm):
    from tests.conftest import TEXT_PROMPTS
    runner = _runner(llm)
    if not runner.use_kernels:
        pytest.skip("engine runs without kernels")
    long_prompt = " ".join(TEXT_PROMPTS) * 8  # a few hundred tokens: several blocks
    prompts = TEXT_PROMPTS[:3] + [long_prompt]
    got = _greedy(llm, prompts, 12)
    with runner_path(runner, kernels=False):
        want = _greedy(llm, prompts, 12)
    assert got == want


def test_fp32_chunked_prefill_mixed_steps_match_eager(gguf_path):
    from servelm import LLM
    from tests.conftest import TEXT_PROMPTS
    # A small token budget: the long prompt is prefilled in chunks while others decode.
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=64,
              max_num_seqs=8)
    runner = _runner(llm)
    if not runner.use_kernels:
        pytest.skip("engine runs without kernels")
    prompts = [TEXT_PROMPTS[0], " ".join(TEXT_PROMPTS) * 4, TEXT_PROMPTS[3]]
    got = _greedy(llm, prompts, 10)
    with runner_path(runner, kernels=False):
        want = _greedy(llm, prompts, 10)
    assert got == want


@pytest.mark.parametrize("kernels", [True, False])
def test_sampled_only_forward_is_the_full_forward_at_the_sampled_rows(llm, kernels):
    # A decode, a prompt whose last token samples and a chunk that does not: the last layer
    # runs o_proj and the MLP for the two sampled rows only; every token's K/V is written.
    runner, bm = _runner(llm), llm.engine.block_manager
    if kernels and not runner.use_kernels:
        pytest.skip("engine runs without kernels")
    owners = ["so-a", "so-b", "so-c"]
    for o, n in zip(owners, (31, 20, 40)):
        bm.allocate(o, n)
    try:
        seqs = [SeqInput([11], 30, bm.block_table("so-a")),
                SeqInput(list(range(300, 320)), 0, bm.block_table("so-b")),
                SeqInput(list(range(500, 540)), 0, bm.block_table("so-c"), sample=False)]
        with runner_path(runner, kernels=kernels):
            batch, sampled = build_forward_batch(seqs, runner.kv_cache.block_size,
                                                 runner.num_queries_per_kv, runner.device,
                                                 runner.attention)
            assert sampled == [0, 1]
            kv = runner.kv_cache
            ours = torch.tensor([b for o in owners for b in bm.block_table(o)])
            with torch.inference_mode():
                kv.data[:, :, ours] = 0
                full = llm.engine.executor.model(batch, kv.layers)
                kv_full = kv.data[:, :, ours].clone()
                kv.data[:, :, ours] = 0
                part = llm.engine.executor.model(batch, kv.layers, sampled_only=True)
        assert part.shape == (2, full.shape[1]) and full.shape[0] == 61
        torch.testing.assert_close(part, full[batch.logits_indices], rtol=1e-4, atol=1e-4)
        assert torch.equal(kv.data[:, :, ours], kv_full) and kv_full.any()
    finally:
        for o in owners:
            bm.free(o)


# ---- prompt (prefill) attention: the flash-style op over the block tables ----------------------

def _prefill_setup(specs, kvh, g, d, bs, dtype, seed=0):
    """The same data as _prefill_op_setup (below), as the engine's AttnGroup for the layer
    function: q, the caches and the group built from each sequence's block table."""
    q, kc, vc, tables, _, _ = _prefill_op_setup(specs, kvh, g, d, bs, dtype, seed)
    seqs = [SeqInput(list(range(n)), s, tables[b, :-(-(s + n) // bs)].tolist())
            for b, (s, n) in enumerate(specs)]
    return q, kc, vc, build_group(seqs, 0, bs, g, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("specs", [[(0, 37)], [(0, 5), (20, 17), (64, 2), (3, 40)],
                                   [(100, 16), (0, 16)], [(0, 200)], [(40, 520)]])
def test_prefill_attention_matches_sdpa(dtype, g, specs):
    # The kernel path's prompt attention (group -> int32 metadata -> the flash-style op) vs SDPA.
    q, kc, vc, grp = _prefill_setup(specs, kvh=3, g=g, d=64, bs=16, dtype=dtype)
    got = paged_prefill_attention(q, kc, vc, grp, 0.125)
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * 64)
    want = paged_attention(q.float(), kc.float(), vc.float(), grp, 0.125)  # SDPA, fp32
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got.float(), want, **tol)


# ---- prompt attention: the flash-style op over the block tables ---------------------------------

def _prefill_op_setup(specs, kvh, g, d, bs, dtype, seed=0):
    """specs: (cached context, chunk length) per sequence. Returns the op's arguments: q
    [T, H, D] (sequences' chunks one after another), caches with the blocks of each sequence
    scattered over the pool in shuffled order, int32 tables (wider than needed, padded with
    block 0), cu_seqlens_q, start_pos."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // bs) for s, n in specs]
    nb = sum(need) + 3
    kc = torch.randn(nb, bs, kvh, d, generator=gen).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = torch.zeros(len(specs), max(need) + 2, dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = torch.tensor(perm[used:used + k], dtype=torch.int32)
        used += k
    q = (torch.randn(sum(n for _, n in specs), kvh * g, d, generator=gen) * 2).to(dtype)
    cu = torch.tensor([0] + torch.tensor([n for _, n in specs]).cumsum(0).tolist(), dtype=torch.int32)
    start = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    return q, kc, vc, tables, cu, start


def _prefill_ref(q, kc, vc, tables, cu, start, scale):
    """Dense causal attention per sequence in float64: query i of sequence b sits at position
    start[b] + i and sees keys 0..start[b] + i, read through the block table."""
    bs, kvh, d = kc.shape[1:]
    h = q.shape[1]
    out = torch.empty(q.shape[0], h * d, dtype=torch.float64)
    for b in range(len(start)):
        q0, q1, s = int(cu[b]), int(cu[b + 1]), int(start[b])
        n = s + q1 - q0
        blocks = tables[b, :-(-n // bs)].long()
        k = kc[blocks].reshape(-1, kvh, d)[:n].double().repeat_interleave(h // kvh, 1)  # [n, H, D]
        v = vc[blocks].reshape(-1, kvh, d)[:n].double().repeat_interleave(h // kvh, 1)
        sc = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * scale
        pos = torch.arange(s, n).view(-1, 1)
        sc = sc.masked_fill(torch.arange(n).view(1, -1) > pos, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v).reshape(q1 - q0, -1)
    return out


PREFILL_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
               torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("specs", [
    [(0, 1)], [(0, 17)], [(0, 300)],                  # one sequence from position 0
    [(384, 128)], [(37, 17)], [(5, 1)], [(100, 300)],  # after cached tokens (block multiple or not)
    [(0, 5), (20, 17), (64, 2), (3, 40), (0, 1)],      # ragged sequences in one call
    [(0, 128)] * 4,
])
def test_paged_prefill_attention_op_matches_dense_reference(dtype, g, specs):
    q, kc, vc, tables, cu, start = _prefill_op_setup(specs, kvh=3, g=g, d=64, bs=16, dtype=dtype)
    got = ops().paged_prefill_attention(q, kc, vc, tables, cu, start, 0.125)
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * 64)
    want = _prefill_ref(q, kc, vc, tables, cu, start, 0.125)
    torch.testing.assert_close(got.double(), want, **PREFILL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_op_strided_q_other_head_dims(dtype):
    # q as a view into wider rows (as qkv[:, :q_size] is); head dims 128 (block size 32, four
    # query heads per KV head) and 80 (a multiple of 16 without a specialised kernel).
    for d, bs, kvh, g in ((128, 32, 2, 4), (80, 16, 1, 2)):
        specs = [(0, 40), (70, 33), (3, 1)]
        q, kc, vc, tables, cu, start = _prefill_op_setup(specs, kvh=kvh, g=g, d=d, bs=bs, dtype=dtype, seed=5)
        T, H = q.shape[:2]
        wide = torch.randn(T, H * d + 3 * d).to(dtype)
        wide[:, :H * d] = q.reshape(T, -1)
        qv = wide[:, :H * d].view(T, H, d)
        got = ops().paged_prefill_attention(qv, kc, vc, tables, cu, start, d ** -0.5)
        want = _prefill_ref(q, kc, vc, tables, cu, start, d ** -0.5)
        torch.testing.assert_close(got.double(), want, **PREFILL_TOL[dtype])


def test_paged_prefill_attention_op_reads_only_visible_keys():
    # Cache slots past each sequence's last position (rest of its last block, unused blocks)
    # hold NaN: they must never be read, nor turn masked probabilities into NaN.
    specs = [(0, 20), (30, 3), (16, 16)]
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, cu, start = _prefill_op_setup(specs, kvh=3, g=3, d=64, bs=16, dtype=dtype)
        want = _prefill_ref(q, kc, vc, tables, cu, start, 0.125)
        used = torch.zeros(kc.shape[0] * 16, dtype=torch.bool)
        for b, (s, n) in enumerate(specs):
            for p in range(s + n):
                used[int(tables[b, p // 16]) * 16 + p % 16] = True
        kc.view(-1, 3, 64)[~used] = float("nan")
        vc.view(-1, 3, 64)[~used] = float("nan")
        got = ops().paged_prefill_attention(q, kc, vc, tables, cu, start, 0.125)
        torch.testing.assert_close(got.double(), want, **PREFILL_TOL[dtype])


def test_paged_prefill_attention_op_rejects_bad_arguments():
    q, kc, vc, tables, cu, start = _prefill_op_setup([(0, 20), (8, 9)], kvh=3, g=3, d=64, bs=16,
                                                     dtype=torch.float32)
    op = ops().paged_prefill_attention
    with pytest.raises(RuntimeError, match="block table holds"):
        op(q, kc, vc, tables[:, :1].contiguous(), cu, start, 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens_q"):
        op(q, kc, vc, tables, cu.long(), start, 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens_q"):
        op(q, kc, vc, tables, torch.tensor([0, 20, 28], dtype=torch.int32), start, 0.125)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, kc, vc, bad, cu, start, 0.125)
    with pytest.raises(RuntimeError, match="head dim 40 unsupported"):
        q2, kc2, vc2, t2, cu2, s2 = _prefill_op_setup([(0, 5)], kvh=1, g=1, d=40, bs=16, dtype=torch.float32)
        op(q2, kc2, vc2, t2, cu2, s2, 0.125)
    # The model options: one sink per query head, no negative window, chunk or soft-cap.
    with pytest.raises(RuntimeError, match=r"sinks must hold one float per query head \(9\)"):
        op(q, kc, vc, tables, cu, start, 0.125, sinks=torch.zeros(3))
    for bad_opt, msg in ((dict(window=-1), "window must be >= 0"), (dict(chunk=-2), "chunk must"),
                         (dict(softcap=-1.0), "softcap must")):
        with pytest.raises(RuntimeError, match=msg):
            op(q, kc, vc, tables, cu, start, 0.125, **bad_opt)
    qd, kcd, vcd, td, cl = _paged_setup([5, 9], kvh=3, g=3, d=64, bs=16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="sinks must hold one float per query head"):
        ops().paged_decode_attention(qd, kcd, vcd, td, cl, 0.125, sinks=torch.zeros(2, 9))
    with pytest.raises(RuntimeError, match="chunk must"):
        ops().paged_decode_attention(qd, kcd, vcd, td, cl, 0.125, chunk=-1)


def test_prefill_attention_other_head_dim_falls_back_to_sdpa():
    # The cpu backend's paged_prefill_attention sends head dims the op does not take to SDPA.
    q, kc, vc, grp = _prefill_setup([(0, 9), (17, 4)], kvh=2, g=2, d=40, bs=16, dtype=torch.float32)
    got = paged_prefill_attention(q, kc, vc, grp, 0.2)
    torch.testing.assert_close(got, paged_attention(q, kc, vc, grp, 0.2), atol=1e-6, rtol=1e-5)


def test_fp32_prefix_cache_hit_with_kernels_matches_eager(gguf_path):
    # A prompt whose first blocks are already cached: its prefill chunk starts at start_pos > 0
    # and attends to the cached keys through the block table.
    from servelm import LLM
    from tests.conftest import TEXT_PROMPTS
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20)
    runner = _runner(llm)
    if not runner.use_kernels:
        pytest.skip("engine runs without kernels")
    base = " ".join(TEXT_PROMPTS) * 3
    prompts = [base, base + " And then", base[:-7] + " The end of"]
    got = [_greedy(llm, [p], 8)[0] for p in prompts]   # one by one: later ones hit the cache
    with runner_path(runner, kernels=False):
        want = [_greedy(llm, [p], 8)[0] for p in prompts]
    assert got == want
