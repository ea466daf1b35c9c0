"""The "q8act" linear method: int4 layers times activations quantised per call to int8
(kernels/csrc/q8act.cpp; AVX2 + F16C, and AVX-512 VNNI where the CPU has it: the same bits),
for bf16 activations.

Each activation row is quantised per block of 32 inputs to int8 (d = max|x| / 127), the
products summed exactly in integers by the AVX2 byte multiply-add (four times the products
of an fp32 FMA a vector), then scaled per block in fp32. That is llama.cpp's Q4_0 x Q8_0 and
OpenVINO's CPU dynamic quantisation (groups of 32): a batch or a prompt, compute-bound, runs
up to about twice the fp32 panels' rate. The price is the activations' rounding: about 8
bits a block, coarser than bf16's (the model-level effect: docs/kernels.md, "q8act"; tested in
tests/test_quantization.py), so the method applies to bf16 activations only (fp32 runs keep
fp32-accurate methods). Each
row is quantised and reduced on its own, in order: its bits do not depend on the row count.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops

NR = 16     # outputs per panel
BLOCK = 32  # inputs per activation block


def available() -> bool:
    """Whether the q8act kernel is built for this CPU (AVX2, FMA and F16C)."""
    return load_ops("q8act") and hasattr(torch.ops.servelm_q8act, "int4_linear")


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """An int4 layer on the CPU (groups a multiple of 32) with bf16 activations."""
    from servelm.quantization.formats import Int4Linear

    return (isinstance(src, Int4Linear) and act == torch.bfloat16
            and src.qweight.device.type == "cpu" and src.group_size % BLOCK == 0
            and available())


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [16T, K] in 0..15 (rows padded to 16) -> [T, K / 32, 2, 4, 32]: per panel of
    16 outputs, block of 32 inputs, half h (outputs 8h .. 8h + 7) and chunk c, byte 4o + t
    holds output o's q at input 8c + t (low nibble) and 8c + 4 + t (high nibble)."""
    n16, k = q.shape
    # [T, half, o, block, chunk, nibble, t] -> [T, block, half, chunk, o, t, nibble]
    q = q.reshape(n16 // NR, 2, 8, k // BLOCK, 4, 2, 4).permute(0, 3, 1, 4, 2, 6, 5)
    return (q[..., 0] | (q[..., 1] << 4)).reshape(n16 // NR, k // BLOCK, 2, 4, 32).contiguous()


def panels_of(qweight: torch.Tensor) -> torch.Tensor:
    """An Int4Linear-layout weight's nibbles (quantize_int4's tiles) in pack_q4's panels:
    the same bytes reordered in C++ where the int4 codec is built, else in PyTorch."""
    from servelm.quantization.numerics import int4_codec, unpack_int4

    if int4_codec(qweight) and qweight.is_contiguous():
        return torch.ops.servelm_int4_codec.to_q8act(qweight)
    return pack_q4(unpack_int4(qweight))


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """pack_q4's inverse: [T, K / 32, 2, 4, 32] -> q uint8 [16T, K] in 0..15."""
    T, B = packed.shape[:2]
    b = packed.reshape(T, B, 2, 4, 8, 4)                     # [T, block, half, chunk, o, t]
    q = torch.stack((b & 15, b >> 4), dim=-1)                 # ... nibble
    return q.permute(0, 2, 4, 1, 3, 6, 5).reshape(T * NR, B * BLOCK)


def dequantize_q4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  dtype=torch.float32) -> torch.Tensor:
    """The weight [16T, K] of packed (pack_q4's layout) with Int4Linear's group scales and
    mins (float16 [T, K / G, 16]: w = s q + m)."""
    q = unpack_q4(packed).float()
    T, G = scales.shape[:2]
    tile = lambda t: t.float().transpose(1, 2).reshape(T * NR, G, 1)  # noqa: E731
    w = q.reshape(T * NR, G, -1) * tile(scales) + tile(mins)
    return w.reshape(q.shape).to(dtype)


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x [..., K] (fp32 arithmetic): (q int8 [..., K], d fp32
    [..., K / 32]); the kernel computes x' @ w.T for x' = q * d (each block's d)."""
    xb = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).to(torch.int8)
    return q.reshape(x.shape), (amax / 127.0).squeeze(-1)


class Int4Q8Linear(nn.Module):
    """An int4 layer on q8act.cpp: the nibbles repacked for the byte multiply-add (4 bits a
    weight), the group scales and mins shared with the source (float16 [ceil(N / 16), K / G,
    16]), the bias in fp32; bf16 (or fp32) activations in, the output in their dtype."""

    packed_tensors = ("qweight", "scales", "mins", "bias")
    compute_dtype = torch.bfloat16  # the known-answer check's tolerance: not fp32-accurate

    def __init__(self, src):
        super().__init__()
        if not available():
            raise RuntimeError("the q8act kernel is not built for this CPU (AVX2, FMA, F16C)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.group_size = src.group_size
        self.register_buffer("qweight", panels_of(src.qweight))
        self.register_buffer("scales", src.scales)
        self.register_buffer("mins", src.mins)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_q8act.int4_linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.qweight, self.scales, self.mins, self.group_size,
                        self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 x int8 activations (AVX2), group_size={self.group_size}")
