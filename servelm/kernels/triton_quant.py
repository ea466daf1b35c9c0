"""Triton kernel that dequantises an int4 layer's tiled weights (servelm.quantization's
layout) into a dense [N, K] matrix, in one pass.

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
