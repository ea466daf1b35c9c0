"""Triton kernels for quantised layers on CUDA: the int4 layer's tiled weights
(servelm.quantization.numerics' layout) dequantised into a dense [N, K] matrix in one pass, and the
int8 layer's matmul with its weight converted in registers.

CUDA runs an int4 layer through tinygemm up to `CUDA_INT4_MAX_ROWS` rows; past that the
weight is dequantised for one dense matmul, and that dequantisation must cost about what
reading the int4 bytes and writing the dense ones costs. The PyTorch reference
(`dequantize_int4_reference`: unpack, then scale and shift per group) makes several full
temporaries and ran at ~60 GB/s on an H200; this kernel reads the packed words and the
groups' scales and mins through the cache (a word serves 8 columns of a row, a scale a
group's) and writes the dense weight once: 4-9x the reference there.

Every element: t, r = divmod(n, 16); b, i = divmod(k, 8); the int32 word (t, b, r) of the
packed tiles holds q[16t + r, 8b + i] at bit 4 (i // 2) + 16 (i % 2), and
w = s[t, k // G, r] * q + m[t, k // G, r], computed in fp32, stored in the output's dtype.
Tests run it in Triton's interpreter on CPU tensors against the reference.

int8 (`int8_linear`): y = (x @ q^T) * s + bias for q int8 [N, K] and one scale per output
row, for the few rows of decode steps. Converting q to the activations' dtype first, as
the fallback does, reads a byte and writes two per weight before the matmul reads those
two; here each program loads a [BLOCK_K, BLOCK_N] tile of int8 codes, converts it in
registers and multiplies it with the activations' tile (exact products, fp32 sums, scaled
once, rounded once to the output dtype), so the weight is read once, a byte per weight.

w8a8 (`w8a8_quantize`, `w8a8_linear`): servelm.layers.w8a8's int8-activation matmul on
int8 tensor cores, for prompts and batches. A row is divided by the smoothing factors and
quantised per block of B inputs to int8 with one fp32 scale d per block (round to nearest
even, d = max|a| / 127), as the CPU kernel does; the weight is int8 [N, K] with one scale
per output channel and block. Each program multiplies a [BLOCK_M, BLOCK_N] tile block by
block: the block's products summed exactly in int32 by `tl.dot`, then scaled by d times the
block's weight scales and chained in fp32 in block order.
"""

from __future__ import annotations

import torch

from servelm.kernels.triton_attention import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequantize_int4_kernel(words, scales, mins, out, N, K, G: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (n[:, None] < N) & (k[None, :] < K)
        t, r = n // 16, n % 16
        i = k % 8
        word = (t[:, None] * (K // 8) + (k // 8)[None, :]) * 16 + r[:, None]
        shift = (i // 2) * 4 + (i % 2) * 16
        q = (tl.load(words + word, mask=mask, other=0) >> shift[None, :]) & 15
        group = (t[:, None] * (K // G) + (k // G)[None, :]) * 16 + r[:, None]
        s = tl.load(scales + group, mask=mask, other=0).to(tl.float32)
        m = tl.load(mins + group, mask=mask, other=0).to(tl.float32)
        w = q.to(tl.float32) * s + m
        dst = out + n[:, None].to(tl.int64) * K + k[None, :]
        tl.store(dst, w.to(out.dtype.element_ty), mask=mask)


    @triton.jit
    def _int8_linear_kernel(x, q, s, bias, out, M, N, K, stride_xm, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            a = tl.load(x + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(q + n[None, :].to(tl.int64) * K + k[:, None],
                        mask=(n[None, :] < N) & (k[:, None] < K), other=0)
            # In fp32: tf32 on CUDA holds an int8 code and a bf16 or fp16 activation exactly,
            # so the products are exact either way (and Triton's interpreter converts int8 to
            # bf16 wrongly).
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        acc *= tl.load(s + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        dst = out + m[:, None].to(tl.int64) * N + n[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


    @triton.jit
    def _w8a8_quantize_kernel(x, inv, q, d, M, K, stride_xm, BLOCK: tl.constexpr,
                              BLOCK_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        b = tl.program_id(1)
        j = tl.arange(0, BLOCK_P2)
        k = b * BLOCK + j
        mask = (m[:, None] < M) & (j[None, :] < BLOCK)
        a = (tl.load(x + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=mask,
                     other=0.0).to(tl.float32)
             * tl.load(inv + k, mask=j < BLOCK, other=0.0)[None, :])
        amax = tl.max(tl.abs(a), axis=1)
        c127 = tl.full((BLOCK_M,), 127.0, tl.float32)
        scale = tl.where(amax > 0, tl.math.div_rn(c127, tl.maximum(amax, 1e-30)), 0.0)
        # Round to nearest even (|a * scale| <= 127): 1.5 * 2^23 added and taken away.
        r = (a * scale[:, None] + 12582912.0) - 12582912.0
        tl.store(q + m[:, None].to(tl.int64) * K + k[None, :], r.to(tl.int8), mask=mask)
        nb = K // BLOCK
        tl.store(d + m.to(tl.int64) * nb + b, tl.math.div_rn(amax, c127),
                 mask=m < M)


    @triton.jit
    def _w8a8_linear_kernel(q, d, w, ws, bias, out, M, N, K, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, SUB)
        nb = K // BLOCK
        m_ok, n_ok = m < M, n < N
        rows = m.to(tl.int64) * K
        cols = n.to(tl.int64) * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(0, nb):
            sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for s in tl.static_range(0, BLOCK, SUB):
                k = b * BLOCK + s + kk
                a = tl.load(q + rows[:, None] + k[None, :], mask=m_ok[:, None], other=0)
                wt = tl.load(w + cols[None, :] + k[:, None], mask=n_ok[None, :], other=0)
                sums += tl.dot(a, wt, out_dtype=tl.int32)
            db = tl.load(d + m.to(tl.int64) * nb + b, mask=m_ok, other=0.0)
            wb = tl.load(ws + n.to(tl.int64) * nb + b, mask=n_ok, other=0.0)
            acc += sums.to(tl.float32) * (db[:, None] * wb[None, :])
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dst = out + m[:, None].to(tl.int64) * N + n[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as rows [M, K] whose elements are adjacent (the kernels take a row stride)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def w8a8_quantize(x: torch.Tensor, inv: torch.Tensor,
                  block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., K] (fp32, bf16 or fp16) times inv [K] (fp32: 1 / the smoothing factors),
    quantised per block of `block` inputs: (q int8 [M, K], d fp32 [M, K / block]) with
    x * inv ~ q * d, as servelm.layers.w8a8.reference computes them."""
    if not available():
        raise RuntimeError("Triton is not installed")
    K = x.shape[-1]
    if (block <= 0 or block % 16 or K % block or inv.shape != (K,) or inv.dtype != torch.float32
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"w8a8 operands do not agree: x {tuple(x.shape)} {x.dtype}, inv "
                         f"{tuple(inv.shape)} {inv.dtype}, block {block}")
    x2 = _rows(x)
    M = x2.shape[0]
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    d = torch.empty(M, K // block, dtype=torch.float32, device=x.device)
    if M:
        block_m = 16
        grid = (triton.cdiv(M, block_m), K // block)
        _w8a8_quantize_kernel[grid](x2, inv.contiguous(), q, d, M, K, x2.stride(0), BLOCK=block,
                                    BLOCK_P2=triton.next_power_of_2(block), BLOCK_M=block_m)
    return q, d


def w8a8_linear(x: torch.Tensor, inv: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                block: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] smoothed and quantised by `w8a8_quantize`, times the int8 weight [N, K]
    with one fp32 scale per output channel and block (scale [N, K / block]), plus bias [N]:
    [..., N] in x's dtype (fp32 sums: each block's exact int32 sum times d times its weight
    scale)."""
    N, K = weight.shape
    if (weight.dtype != torch.int8 or x.shape[-1] != K or block <= 0 or K % block
            or scale.shape != (N, K // block) or scale.dtype != torch.float32
            or (bias is not None and bias.numel() != N)):
        raise ValueError(f"w8a8 operands do not agree: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} "
                         f"{scale.dtype}, block {block}, bias "
                         f"{None if bias is None else tuple(bias.shape)}")
    q, d = w8a8_quantize(x, inv, block)
    M = q.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
        block_n = 64 if M <= 64 else 128
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _w8a8_linear_kernel[grid](q, d, weight.contiguous(), scale.contiguous(),
                                  bias if bias is not None else scale, out, M, N, K,
                                  HAS_BIAS=bias is not None, BLOCK=block,
                                  SUB=32 if block % 32 == 0 else 16, BLOCK_M=block_m,
                                  BLOCK_N=block_n)
    return out.reshape(*x.shape[:-1], N)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 or fp16, which tf32 holds exactly; not fp32) times the int8 weight
    q [N, K] with per-row scales [>= N] (+ bias [N]): [..., N] in x's dtype, fp32 sums."""
    if not available():
        raise RuntimeError("Triton is not installed")
    N, K = q.shape
    if (q.dtype != torch.int8 or x.dtype not in (torch.bfloat16, torch.float16)
            or x.shape[-1] != K or scales.numel() < N or (bias is not None and bias.numel() != N)):
        raise ValueError(f"int8 operands do not agree: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} "
                         f"{q.dtype}, scales {tuple(scales.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}")
    x2 = _rows(x)
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        # Few rows: narrow column blocks so every SM streams a share of the weight.
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n, block_k = (32, 128) if M <= 32 else (64, 64)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _int8_linear_kernel[grid](x2, q.contiguous(), scales.contiguous(),
                                  bias if bias is not None else scales, out, M, N, K,
                                  x2.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*x.shape[:-1], N)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int, out_features: int,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight of `quantize_int4`'s (packed, scales, mins), [out_features, K] in dtype."""
    if not available():
        raise RuntimeError("Triton is not installed")
    T, K8 = packed.shape
    K = K8 // 8
    if out_features > 16 * T or K % group_size or tuple(scales.shape) != (T, K // group_size, 16):
        raise ValueError(f"int4 operands do not agree: packed {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)}, group_size {group_size}, "
                         f"out_features {out_features}")
    out = torch.empty(out_features, K, dtype=dtype, device=packed.device)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(K, block_k))
    _dequantize_int4_kernel[grid](packed.contiguous().view(torch.int32), scales.contiguous(),
                                  mins.contiguous(), out, out_features, K, group_size,
                                  BLOCK_N=block_n, BLOCK_K=block_k)
    return out
