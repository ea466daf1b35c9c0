"""KV-cache quantisation (CacheConfig.kv_cache_dtype): how K and V rows are stored in the pool.

"int8": symmetric, one fp32 scale per token and KV head (scale = max |x| / 127, q =
round(x / scale)); "fp8": float8 e4m3 with the same per-row scale (scale = max |x| / 448,
so each row uses the format's whole range). A quantised pool stores the rows in the 1-byte
dtype and the scales beside them ([..., KVH] fp32); every attention backend reads both and
dequantises what it reads (the PyTorch reference here, the C++ CPU kernels, Triton).
These functions are the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

# kv_cache_dtype -> (storage dtype, largest magnitude it holds); "auto" is the model dtype.
_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _FORMATS[kv_cache_dtype][0] if kv_cache_dtype in _FORMATS else model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.int8, torch.float8_e4m3fn)


def bits_per_element(dtype: torch.dtype, head_dim: int) -> float:
    """Pool bits per cached K or V element of a pool stored as `dtype`, the scales (one
    fp32 per head_dim elements) included: 8.5 for int8 at head_dim 64, 16 for bf16."""
    bits = torch.empty(0, dtype=dtype).element_size() * 8
    return bits + (32 / head_dim if is_quantized(dtype) else 0)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (rows [..., D] of `dtype`, fp32 scales [...]): x ~= rows * scale."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    # An all-zero row keeps scale 0 and rows 0 (no division by zero).
    y = xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    if dtype == torch.int8:
        return y.round().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(dtype), scale


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), through a uint8 view for fp8 (whose indexing kernels
    not every device build has; the bytes are the same)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.index_select(0, index)
    return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)


def dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., D] (int8 / fp8), scale [...] fp32 -> [..., D] of `dtype`."""
    return (rows.float() * scale.unsqueeze(-1)).to(dtype)


def write(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
          x: torch.Tensor) -> None:
    """Store x [T, KVH, D] in cache [num_blocks, block_size, KVH, D] at flat `slots`
    (block * block_size + offset; quantised, with its scales [num_blocks, block_size, KVH],
    when the cache is). The cache may be a view of pages larger than its blocks (a pool in
    block groups): any block stride."""
    bs = cache.shape[1]
    block, off = slots // bs, slots % bs
    if scales is None:
        cache[block, off] = x
        return
    q, s = quantize(x, cache.dtype)
    if q.dtype == torch.float8_e4m3fn:  # stored as bytes (see gather_rows)
        cache, q = cache.view(torch.uint8), q.view(torch.uint8)
    cache[block, off] = q
    scales[block, off] = s
