"""Paged attention for CUDA in Triton: each row's keys and values are read in place through
its block table, never gathered into a new tensor.

The eager CUDA path gathers every row's whole block table into a padded K/V copy and runs
SDPA over it (with a mask for prompts): for 64 rows of 512 tokens of a Llama-3-8B that is
~4-5 GB copied per decode step (written, then read back), several times the K/V the step
needs to read. Here each program reads only the keys its rows attend to.

Decode (`paged_decode_attention`, one query a row; split-K, "flash decoding"):

- stage 1, grid (rows, KV heads, splits): one program takes one KV head of one row and
  one slice of its context; the G query heads sharing that KV head are the rows of one
  tile (grouped-query attention: each K/V element is read once for all G heads), padded
  to 16 for the dot product. Keys are walked BLOCK_N at a time, each token's address
  found through the block table, with an online softmax in fp32. It writes the slice's
  normalised output and log-sum-exp, or with one split the final output directly;
- stage 2, grid (rows, heads): the splits' outputs merged by their log-sum-exp weights.

The split count depends only on the batch size and the table width, never on the rows'
lengths, so a captured CUDA graph keeps a fixed grid (`DecodeGraphs`); a split past a
row's length is empty and weighs nothing in the merge.

Prompt chunks (`paged_prefill_attention`, ragged query counts and start positions, the
C++ prompt kernel's metadata): grid (query tiles, sequences, KV heads), each program a
tile of (token, head) rows sharing one KV head, walking the keys up to its last token
with a causal mask; no padding to the longest prompt and no mask tensor.

A quantised cache (kv_cache_dtype int8 or fp8, servelm.models.kv_quant) comes with its
scales [num_blocks, page, KVH] (fp32, one per token and KV head): both kernels load each
tile's rows and scales and dequantise the tile in registers (`QUANT`), to q's dtype for
the dot products.

Triton is optional: `available()` is False without it (and KernelConfig.triton_attention
off leaves it unused); callers then keep the gather + SDPA path. The CPU tests run these kernels in Triton's
interpreter (TRITON_INTERPRET=1, CPU tensors), against PyTorch references; the
interpreter's dot products are fp32, so there the bf16/fp16 tiles are converted first
(`DOT_FP32`).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

try:  # optional: CUDA builds of torch ship it; the CPU tests install it for the interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


@functools.cache
def available() -> bool:
    return triton is not None


_works: dict[tuple, bool] = {}


def works(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
          head_dim: int, block_size: int, kv_dtype: torch.dtype | None = None,
          options: frozenset[str] = frozenset()) -> bool:
    """available(), and both kernels compile for this shape on this device and agree with
    the PyTorch references on a small case (asked once per shape): a Triton that cannot
    compile them here (an old GPU, a version mismatch) or computes them wrong is logged
    and the caller keeps the gather + SDPA path, instead of failing the first step.
    kv_dtype: the cache's storage dtype when it is quantised (int8, float8_e4m3fn).
    options: the model options the kernels will run ("softcap", "sinks", "chunk": each
    compiles a variant of its own), compiled here too and checked to give finite outputs
    (their values are checked against the reference in the tests)."""
    if not available():
        return False
    kv_dtype = kv_dtype or dtype
    key = (str(device), dtype, num_heads, num_kv_heads, head_dim, block_size)
    key += (kv_dtype,) if kv_dtype != dtype else ()
    key += tuple(sorted(options))
    if key not in _works:
        try:
            _probe(torch.device(device), dtype, num_heads, num_kv_heads, head_dim, block_size,
                   kv_dtype, options)
            _works[key] = True
        except Exception as e:  # noqa: BLE001 - compile errors come as many types
            logger.warning("Triton attention is not used on %s (%s): %s", device, dtype, e)
            _works[key] = False
    return _works[key]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] fp32, each row attending the first lens[b] tokens of its blocks in the
    fp32 caches k, v [blocks, page, KVH, D]: models.layers.paged_decode_attention_ref's
    arithmetic for an unquantised cache and no window, here so the kernels' probe imports
    nothing above them."""
    page, kvh, d = k.shape[1:]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, :-(-n // page)].long()
        kb = k.index_select(0, blocks).reshape(-1, kvh, d)[:n].transpose(0, 1)
        vb = v.index_select(0, blocks).reshape(-1, kvh, d)[:n].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].view(kvh, -1, d), kb, vb,
                                                scale=scale).reshape(-1, d)
    return out


def _probe(device, dtype, H, KVH, D, page, kv_dtype, options=frozenset()):
    from servelm.models import kv_quant

    g = torch.Generator().manual_seed(0)
    n1 = 2 * BLOCK_N + 2  # row 1's context: several BLOCK_N steps, split in two
    W = -(-n1 // page)
    nb = W + 2
    k = torch.randn(nb, page, KVH, D, generator=g).to(dtype)
    v = torch.randn(nb, page, KVH, D, generator=g).to(dtype)
    scales, extra = None, {}
    if kv_quant.is_quantized(kv_dtype):  # the reference reads the dequantised rows
        (k, ks), (v, vs) = kv_quant.quantize(k, kv_dtype), kv_quant.quantize(v, kv_dtype)
        scales, extra = (ks, vs), {"scales": (ks.to(device), vs.to(device))}
    perm = torch.randperm(nb, generator=g)
    tables = torch.stack([perm[:W], perm.flip(0)[:W]]).to(torch.int32)  # scattered blocks
    lens = torch.tensor([3, n1], dtype=torch.int32)
    q = torch.randn(2, H, D, generator=g).to(dtype)
    scale = D ** -0.5
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    kr, vr = k.float(), v.float()
    if scales is not None:
        kr, vr = kr * scales[0].unsqueeze(-1), vr * scales[1].unsqueeze(-1)
    kd, vd, td = k.to(device), v.to(device), tables.to(device)
    want = _reference(q.float(), kr, vr, tables, lens, scale).view(2, -1)
    for splits in (1, 2):  # the final output written directly, and the split merge
        got = paged_decode_attention(q.to(device), kd, vd, td, lens.to(device), scale,
                                     splits=splits, **extra)
        if not torch.allclose(got.float().cpu(), want, rtol=tol, atol=tol):
            raise RuntimeError(f"the decode kernel ({splits} split) disagrees with the reference")
    # Prompt chunks: row 0's 3 tokens from position 0, row 1's last 2.
    qp = torch.randn(5, H, D, generator=g).to(dtype)
    got = paged_prefill_attention(qp.to(device), kd, vd, td,
                                  torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
                                  torch.tensor([0, n1 - 2], dtype=torch.int32, device=device),
                                  3, scale, **extra)
    for i, (b, p) in enumerate([(0, 0), (0, 1), (0, 2), (1, n1 - 2), (1, n1 - 1)]):
        want = _reference(qp[i:i + 1].float(), kr, vr, tables[b:b + 1],
                                          torch.tensor([p + 1]), scale).view(-1)
        if not torch.allclose(got[i].float().cpu(), want, rtol=tol, atol=tol):
            raise RuntimeError("the prompt kernel disagrees with the reference")
    if options:  # the variants the model needs compile and give finite outputs
        opts = dict(window=8, chunk=64 if "chunk" in options else None,
                    softcap=30.0 if "softcap" in options else None,
                    sinks=torch.zeros(H, device=device) if "sinks" in options else None)
        outs = [paged_decode_attention(q.to(device), kd, vd, td, lens.to(device), scale,
                                       splits=splits, **extra, **opts) for splits in (1, 2)]
        outs.append(paged_prefill_attention(
            qp.to(device), kd, vd, td, torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
            torch.tensor([0, n1 - 2], dtype=torch.int32, device=device), 3, scale, **extra,
            **opts))
        if not all(bool(torch.isfinite(o).all()) for o in outs):
            raise RuntimeError(f"the kernels with {sorted(options)} give non-finite outputs")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter (tests)


BLOCK_N = 64       # keys per inner step
MAX_SPLITS = 32
SPLIT_KEYS = 2048  # keys a split walks, at most (until MAX_SPLITS)


def num_splits(batch: int, kv_heads: int, max_keys: int, device: torch.device,
               want: int | None = None, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(splits, keys per split) for `batch` rows whose tables hold at most max_keys keys:
    enough programs to fill the GPU about twice, and at most ~SPLIT_KEYS keys a split (a
    long row among short ones is not one program's serial walk), or `want` splits; each
    with at least one BLOCK_N of keys."""
    steps = max(1, -(-max_keys // block_n))
    if want is None:
        want = max(-(-2 * _num_sms(device) // max(1, batch * kv_heads)),
                   -(-max_keys // SPLIT_KEYS))
    splits = max(1, min(want, steps, MAX_SPLITS))
    per = -(-steps // splits) * block_n
    return -(-max_keys // per), per


if triton is not None:

    @triton.jit
    def _first_key(pos, WINDOW, CHUNK):
        """The first key a query at `pos` sees: its window's (WINDOW > 0), its attention
        chunk's (CHUNK > 0), else 0."""
        lo = pos * 0
        if WINDOW > 0:
            lo = tl.maximum(lo, pos - WINDOW + 1)
        if CHUNK > 0:
            lo = tl.maximum(lo, (pos // CHUNK) * CHUNK)
        return lo

    @triton.jit
    def _softcap(x, CAP):
        """CAP * tanh(x / CAP) (scores and CAP in the same units): tanh(y) = 1 - 2 / (1 +
        e^(2y)), the exponent clamped where tanh is +-1 in fp32."""
        t = tl.minimum(tl.maximum(x * (2.8853900817779268 / CAP), -60.0), 60.0)
        return CAP * (1.0 - 2.0 / (1.0 + tl.math.exp2(t)))

    # Lengths and table widths vary step to step: one compiled kernel for all of them.
    @triton.jit(do_not_specialize=["split_len", "st_b", "window", "chunk"])
    def _decode_stage1(Q, K, V, KS, VS, Tables, Lens, Out, Lse, Final, Sinks,
                       split_len, scale_log2, window, chunk, cap_log2,
                       sq_b, sq_h, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h,
                       ss_blk, ss_tok, ss_h, st_b,
                       so_b, so_h, so_s, sl_b, sl_h, sf_b, sf_h,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       DIRECT: tl.constexpr, DOT_FP32: tl.constexpr,
                       PRECISION: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
                       SINKS: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(Lens + b).to(tl.int32)
        # The split's keys, from the row's first (a window or chunk: the splits before it
        # are empty).
        start = tl.maximum(s * split_len, _first_key(n - 1, window, chunk))
        end = tl.minimum(s * split_len + split_len, n)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            blk = tl.load(Tables + b * st_b + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            tok = offs_n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K + (blk * sk_blk + tok * sk_tok + kvh * sk_h)[:, None] + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            if QUANT:  # int8 / fp8 rows times their scales, in q's dtype
                srow = blk * ss_blk + tok * ss_tok + kvh * ss_h
                ks = tl.load(KS + srow, mask=n_mask, other=0.0)
                k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
            if DOT_FP32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if SOFTCAP:
                scores = _softcap(scores, cap_log2)
            scores = tl.where(n_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(V + (blk * sv_blk + tok * sv_tok + kvh * sv_h)[:, None] + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            if QUANT:
                vs = tl.load(VS + srow, mask=n_mask, other=0.0)
                v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
            if DOT_FP32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        nonempty = l_sum > 0
        total = l_sum
        if SINKS and DIRECT:  # the sink joins the sum (split: in stage 2, over the splits)
            sink = tl.load(Sinks + heads, mask=g_mask, other=0.0) * 1.4426950408889634
            total += tl.math.exp2(tl.minimum(sink - m, 126.0))
        out = acc / tl.where(nonempty, total, 1.0)[:, None]
        out_mask = g_mask[:, None] & d_mask[None, :]
        if DIRECT:
            tl.store(Final + b * sf_b + heads[:, None] * sf_h + offs_d[None, :],
                     out.to(Final.dtype.element_ty), mask=out_mask)
        else:
            tl.store(Out + b * so_b + heads[:, None] * so_h + s * so_s + offs_d[None, :], out,
                     mask=out_mask)
            lse = tl.where(nonempty, m + tl.math.log2(tl.where(nonempty, l_sum, 1.0)),
                           float("-inf"))
            tl.store(Lse + b * sl_b + heads * sl_h + s, lse, mask=g_mask)

    @triton.jit(do_not_specialize=["splits"])
    def _decode_stage2(Out, Lse, Final, Sinks, splits, so_b, so_h, so_s, sl_b, sl_h, sf_b,
                       sf_h, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                       SINKS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < splits
        lse = tl.load(Lse + b * sl_b + h * sl_h + offs_s, mask=s_mask, other=float("-inf"))
        top = tl.max(lse, 0)  # the split holding the row's last key is never empty: finite
        w = tl.math.exp2(lse - top)
        total = tl.sum(w, 0)
        if SINKS:  # the sink joins the sum of every split's
            total += tl.math.exp2(tl.minimum(tl.load(Sinks + h) * 1.4426950408889634 - top, 126.0))
        w = w / total
        o = tl.load(Out + b * so_b + h * so_h + offs_s[:, None] * so_s + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d < D)[None, :], other=0.0)
        res = tl.sum(o * w[:, None], 0)
        tl.store(Final + b * sf_b + h * sf_h + offs_d, res.to(Final.dtype.element_ty),
                 mask=offs_d < D)

    @triton.jit(do_not_specialize=["st_b", "window", "chunk"])
    def _prefill(Q, K, V, KS, VS, Tables, CuQ, StartPos, Out, Sinks, scale_log2, window,
                 chunk, cap_log2,
                 sq_t, sq_h, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, ss_blk, ss_tok, ss_h,
                 st_b, so_t, so_h,
                 G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_R: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                 QUANT: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
        tile = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)
        q0 = tl.load(CuQ + b)
        nq = tl.load(CuQ + b + 1) - q0
        t_first = tile * TOKENS
        if t_first < nq:
            p0 = tl.load(StartPos + b)
            # Rows: (token, head within the KV head's group), token-major.
            offs_r = tl.arange(0, BLOCK_R)
            tok = t_first + offs_r // G
            r_mask = (offs_r < TOKENS * G) & (tok < nq)
            heads = kvh * G + offs_r % G
            offs_d = tl.arange(0, BLOCK_D)
            d_mask = offs_d < D
            rows = (q0 + tok).to(tl.int64)
            q = tl.load(Q + rows[:, None] * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                        mask=r_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
            qpos = p0 + tok                                 # each row's position
            lo = _first_key(qpos, window, chunk)            # each row's first key
            end = p0 + tl.minimum(t_first + TOKENS, nq)     # keys [begin, end): causal bound
            begin = _first_key(p0 + t_first, window, chunk)  # the tile's first row's first key

            m = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_R], tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for k0 in range(begin, end, BLOCK_N):
                offs_n = k0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < end
                blk = tl.load(Tables + b * st_b + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
                slot = offs_n % PAGE
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(K + (blk * sk_blk + slot * sk_tok + kvh * sk_h)[:, None]
                            + offs_d[None, :], mask=kv_mask, other=0.0)
                if QUANT:  # int8 / fp8 rows times their scales, in q's dtype
                    srow = blk * ss_blk + slot * ss_tok + kvh * ss_h
                    ks = tl.load(KS + srow, mask=n_mask, other=0.0)
                    k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
                if DOT_FP32:
                    k = k.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                if SOFTCAP:
                    scores = _softcap(scores, cap_log2)
                seen = (offs_n[None, :] <= qpos[:, None]) & (offs_n[None, :] >= lo[:, None])
                scores = tl.where(seen, scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                # A row that has seen no key yet (its first key lies ahead) keeps m -inf:
                # its exponentials are taken against 0 so they come out 0, not NaN.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(scores - m_ref[:, None])
                alpha = tl.math.exp2(m - m_ref)
                l_sum = l_sum * alpha + tl.sum(p, 1)
                v = tl.load(V + (blk * sv_blk + slot * sv_tok + kvh * sv_h)[:, None]
                            + offs_d[None, :], mask=kv_mask, other=0.0)
                if QUANT:
                    vs = tl.load(VS + srow, mask=n_mask, other=0.0)
                    v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
                if DOT_FP32:
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m = m_new
            # Every real row sees its own key at least: l_sum > 0; padding rows are not
            # stored. The sink, if any, joins each row's sum.
            total = l_sum
            if SINKS:
                sink = tl.load(Sinks + heads, mask=r_mask, other=0.0) * 1.4426950408889634
                total += tl.math.exp2(tl.minimum(sink - m, 126.0))
            out = acc / tl.where(l_sum > 0, total, 1.0)[:, None]
            tl.store(Out + rows[:, None] * so_t + heads[:, None] * so_h + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _check(q, k_cache, v_cache, block_tables):
    """(page, KV heads, query heads per KV head, block tables with a unit last stride) of
    q [n, H, D] over caches [num_blocks, page, KVH, D]; ValueError if they do not fit."""
    _, H, D = q.shape
    _, page, kvh, d_cache = k_cache.shape
    if D != d_cache or H % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) dimension")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return page, kvh, H // kvh, block_tables


def _scale_args(k_cache: torch.Tensor, scales) -> tuple:
    """(K scales, V scales, their three strides) for the kernels; without scales, stand-ins
    the kernels never read (QUANT off)."""
    if scales is None:
        return k_cache, k_cache, 0, 0, 0
    ks, vs = scales
    if ks.shape != k_cache.shape[:3] or vs.stride() != ks.stride():
        raise ValueError(f"scales {tuple(ks.shape)} do not match the cache {tuple(k_cache.shape)}")
    return ks, vs, ks.stride(0), ks.stride(1), ks.stride(2)


def _option_args(q: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None) -> tuple:
    """(sinks in fp32, or a stand-in the kernels never read; the soft-cap in log2 units)."""
    sinks32 = q if sinks is None else sinks.float().contiguous()
    return sinks32, (softcap or 0.0) * 1.4426950408889634


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, splits: int | None = None,
                           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           window: int | None = None, chunk: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """q [B, H, D] (one query per row); k_cache, v_cache [num_blocks, page, KVH, D];
    block_tables [B, W] (int32 or int64; entries past a row's length are never read);
    context_lens [B] (>= 1: row b attends to its first context_lens[b] keys).
    Returns [B, H * D] in q's dtype. Same math as layers.paged_decode_attention_ref.
    `splits` overrides the number of context slices (tests). A quantised cache (int8 or
    fp8 rows) comes with its (k, v) scales [num_blocks, page, KVH]. window, chunk, softcap
    and sinks [H]: the model options, as the reference attention reads them."""
    B, H, D = q.shape
    page, kvh, G, block_tables = _check(q, k_cache, v_cache, block_tables)
    final = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return final.view(0, H * D)
    splits, split_len = num_splits(B, kvh, block_tables.shape[1] * page, q.device, splits)
    interp = q.device.type == "cpu"
    direct = splits == 1
    if direct:
        out = lse = final  # not read: stage 1 writes the final output
    else:
        out = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(max(D, 16))
    ks, vs, *s_strides = _scale_args(k_cache, scales)
    sinks32, cap = _option_args(q, softcap, sinks)
    _decode_stage1[(B, kvh, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, out, lse, final, sinks32,
        split_len, scale * 1.4426950408889634, window or 0, chunk or 0, cap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *s_strides,
        block_tables.stride(0),
        H * splits * D, splits * D, D, H * splits, splits, final.stride(0), final.stride(1),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=block_d, PAGE=page,
        BLOCK_N=BLOCK_N, DIRECT=direct, DOT_FP32=interp,
        PRECISION="ieee" if q.dtype == torch.float32 else None, QUANT=scales is not None,
        SOFTCAP=bool(softcap), SINKS=sinks is not None, num_warps=4, num_stages=2)
    if not direct:
        _decode_stage2[(B, H)](
            out, lse, final, sinks32, splits, H * splits * D, splits * D, D, H * splits, splits,
            final.stride(0), final.stride(1),
            D=D, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
            SINKS=sinks is not None, num_warps=4)
    return final.view(B, H * D)


PREFILL_ROWS = 64  # (token, head) rows a prompt program takes


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_q: torch.Tensor,
                            start_pos: torch.Tensor, max_q: int, scale: float,
                            scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                            window: int | None = None, chunk: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Causal attention of prompt chunks over their block tables, in place (the cache
    already holds the chunks' own K/V). q [T, H, D]: sequence b's queries are the flat
    tokens [cu_q[b], cu_q[b + 1]), at positions start_pos[b], start_pos[b] + 1, ...;
    max_q bounds any sequence's query count (it sizes the grid). Returns [T, H * D].

    Grid (query tiles, sequences, KV heads): a program takes PREFILL_ROWS rows of
    (token, query head) that share one KV head, so each K/V tile is read once for the
    group's heads, and walks the keys up to its last token's position with an online
    softmax, masking each row's future (and keys before its window or chunk, which the
    program's walk starts at). `scales` and the model options: as
    paged_decode_attention's."""
    T, H, D = q.shape
    page, kvh, G, block_tables = _check(q, k_cache, v_cache, block_tables)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    B = cu_q.shape[0] - 1
    if T == 0 or B == 0:
        return out.view(T, H * D)
    block_r = max(PREFILL_ROWS, triton.next_power_of_2(G))
    tokens = block_r // G
    ks, vs, *s_strides = _scale_args(k_cache, scales)
    sinks32, cap = _option_args(q, softcap, sinks)
    _prefill[(-(-max_q // tokens), B, kvh)](
        q, k_cache, v_cache, ks, vs, block_tables, cu_q, start_pos, out, sinks32,
        scale * 1.4426950408889634, window or 0, chunk or 0, cap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *s_strides,
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=G, TOKENS=tokens, BLOCK_R=block_r, D=D,
        BLOCK_D=triton.next_power_of_2(max(D, 16)), PAGE=page, BLOCK_N=BLOCK_N,
        DOT_FP32=q.device.type == "cpu",
        PRECISION="ieee" if q.dtype == torch.float32 else None, QUANT=scales is not None,
        SOFTCAP=bool(softcap), SINKS=sinks is not None, num_warps=4, num_stages=2)
    return out.view(T, H * D)
