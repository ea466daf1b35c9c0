"""GGUF block formats dequantised with torch: the types real checkpoints use, bit for bit
what gguf-py's numpy reference gives (the same float32 operations in the same order), and
far faster (whole tensors at once, on every thread, instead of 16-row groups): loading the
embedded Q4_1 model goes from seconds of dequantising to a fraction of one. The commonest
types (KERNEL_TYPES) run on servelm's C++ twin of these functions when it is built
(kernels/csrc/gguf_dequant.cpp, bit for bit the same): the torch versions' temporaries of
several bytes a weight took ~11 s of a Qwen2.5-1.5B Q4_K_M file's load. MXFP4 too, in
ggml's blocks and in an HF checkpoint's blocks and scales (gpt-oss's experts: mxfp4_hf, bit
for bit transformers' dequantisation)."""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch

QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 (n, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes (n, k*group) -> (n, k, 2, group): low nibbles, then high nibbles, per group."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).to(torch.float32)
    return (d * q) + m


def _fifth_bits(set_: int, clear: int) -> torch.Tensor:
    """Q5_0/Q5_1's high bits: a byte -> its 8 bits, least significant first, each the byte
    `set_` or `clear`, the eight read as one little-endian int64 (a gather moves them at once)."""
    bits = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
    return torch.where(bits, set_, clear).to(torch.uint8).view(torch.int64).reshape(-1)


# Q5_1's 0x10 for a set bit; Q5_0's 0x00 (set) or 0xF0 (clear): a nibble OR'd with that is,
# read as int8, nibble + 16 * bit - 16, the centred value itself.
_FIFTH = {"Q5_1": _fifth_bits(0x10, 0x00), "Q5_0": _fifth_bits(0x00, 0xF0)}
_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_Q5_CHUNK = 65536  # blocks a pass: a pass's temporaries stay small, the output written once


def _q5(b: torch.Tensor, qh_at: int, kind: str) -> torch.Tensor:
    """Q5_0 (d * (q - 16)) and Q5_1 (d * q + m) blocks -> (n, 32) float32. The 5-bit codes
    are built 8 at a time in int64 words (the nibbles masked, the fifth bits gathered from
    _FIFTH), a chunk of blocks at a time; exact integers times the same float32 scales, so
    bit for bit the per-value arithmetic of gguf-py."""
    n = b.shape[0]
    table = _FIFTH[kind]
    out = torch.empty(n, 32, dtype=torch.float32)
    for s in range(0, n, _Q5_CHUNK):
        c = b[s:s + _Q5_CHUNK]
        # (m, 2): values 0-15, 16-31 (a fresh copy: a one-block chunk's slice is "contiguous")
        qs = torch.empty(c.shape[0], 16, dtype=torch.uint8).copy_(c[:, qh_at + 4:])
        qs = qs.view(torch.int64)
        q = table[c[:, qh_at:qh_at + 4].to(torch.int32)]       # (m, 4): their fifth bits
        q[:, :2] |= qs & _LOW_NIBBLES
        q[:, 2:] |= (qs >> 4) & _LOW_NIBBLES
        q = q.view(torch.uint8)
        rows = out[s:s + c.shape[0]]
        if kind == "Q5_0":
            torch.mul(_f16(c, 0), q.view(torch.int8), out=rows)
        else:
            torch.mul(_f16(c, 0), q, out=rows).add_(_f16(c, 2))
    return out


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 2, "Q5_0")


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 4, "Q5_1")


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return ((d * sc.to(torch.float32)).reshape(n, -1, 1),
            (dmin * mn.to(torch.float32)).reshape(n, -1, 1))


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    qh = b[:, 16:16 + QK_K // 8].reshape(n, -1, 1, 32)
    qh = ((qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)) & 1).reshape(n, -1, 32)
    ql = _nibbles(b[:, 16 + QK_K // 8:], 32).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :QK_K // 2], b[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    scales = b[:, 3 * QK_K // 4:3 * QK_K // 4 + QK_K // 16].contiguous().view(torch.int8)
    d = _f16(b, 3 * QK_K // 4 + QK_K // 16)
    d = (d * scales.to(torch.float32)).reshape(n, QK_K // 16, 1)
    ql = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = qh.reshape(n, -1, 1, 32) >> shifts
    qh = (qh & 0x03).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, -1).to(torch.float32)
    return (d * q).reshape(n, QK_K)


# MXFP4 (the OCP microscaling format): blocks of 32 E2M1 values (4 bits: sign, 2 exponent
# bits, 1 mantissa bit) sharing one E8M0 scale byte e, 2^(e - 127). Computed as gguf-py does:
# 2^(e - 128) (from its bits) times the code's value doubled, every product exact. The HF
# codes' table has transformers' -0.0 for code 8, ggml's +0.0.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_DOUBLED = tuple(2 * v for v in E2M1)
_GGML_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mx_values(codes: torch.Tensor, exponents: torch.Tensor, doubled: tuple) -> torch.Tensor:
    """E2M1 codes [..., 32] (uint8) scaled by E8M0 bytes [..., 1] -> float32."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    table = torch.tensor(doubled, dtype=torch.float32, device=codes.device)
    return bits.view(torch.float32) * table[codes.long()]


_MX_CHUNK = 1 << 16  # MXFP4 blocks a pass: its int64 indices stay small (a layer's experts
                    # are hundreds of millions of values), the output written once


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """ggml's block_mxfp4: the scale byte, then 16 bytes whose low nibbles are values 0-15
    and high nibbles values 16-31."""
    out = torch.empty(b.shape[0], 32, dtype=torch.float32)
    for i in range(0, b.shape[0], _MX_CHUNK):
        c = b[i:i + _MX_CHUNK]
        out[i:i + _MX_CHUNK] = _mx_values(_nibbles(c[:, 1:], 16).reshape(c.shape[0], 32),
                                          c[:, :1], _GGML_E2M1_DOUBLED)
    return out


def mxfp4_hf(blocks: torch.Tensor, scales: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An HF checkpoint's MXFP4 tensor (gpt-oss's experts: `*_blocks` [..., G, 16] uint8,
    each byte two values, the low nibble first; `*_scales` [..., G] uint8) -> [..., G * 32]
    in dtype, exactly: what transformers' convert_moe_packed_tensors computes, before its
    final transpose. bf16 by default: exact, and half an fp32 temporary's memory."""
    b = blocks.view(torch.uint8).reshape(-1, 16)
    s = scales.view(torch.uint8).reshape(-1, 1)
    out = torch.empty(b.shape[0], 32, dtype=dtype)
    for i in range(0, b.shape[0], _MX_CHUNK):
        c = b[i:i + _MX_CHUNK]
        codes = torch.stack((c & 0x0F, c >> 4), dim=-1).reshape(c.shape[0], 32)
        out[i:i + _MX_CHUNK] = _mx_values(codes, s[i:i + _MX_CHUNK], _E2M1_DOUBLED)
    return out.view(*blocks.shape[:-2], -1)


# GGML type name -> (elements per block, bytes per block, block dequantiser)
_BLOCKS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1), "Q8_0": (32, 34, _q8_0), "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k), "MXFP4": (32, 17, _mxfp4),
}


KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def supported(type_name: str) -> bool:
    return type_name in _BLOCKS or type_name in ("F32", "F16", "BF16")


def dequantize(data: np.ndarray, type_name: str, kernels: bool = True) -> torch.Tensor | None:
    """float32 elements of a GGUF tensor's data (raw blocks, rows of bytes; or F32/F16/BF16
    values), flattened in row order; None for a type this module does not know. kernels:
    the C++ op for KERNEL_TYPES where it is built (else, and with False, torch)."""
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(-1)
    if type_name == "F16":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float16)).reshape(-1).float()
    if type_name == "BF16":
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        return raw.view(torch.bfloat16).float()
    entry = _BLOCKS.get(type_name)
    if entry is None:
        return None
    _, size, fn = entry
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size % size:
        raise ValueError(f"{type_name} data of {raw.size} bytes is not whole {size}-byte blocks")
    with warnings.catch_warnings():  # a read-only memory map: only ever read here
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(raw).reshape(-1, size)
    if kernels and type_name in KERNEL_TYPES:
        from servelm.kernels import load_ops

        if load_ops("gguf_dequant"):
            return torch.ops.servelm_gguf_dequant.dequantize(blocks, type_name)
    return fn(blocks).reshape(-1)
