"""The "qdot" linear method: int4 / int8 weights in integer dot products
(kernels/csrc/qdot.cpp; AVX2, so it runs on CPUs without AVX-512 too).

Each activation row is quantised on the fly per block of 32 inputs to int16 (x = d h,
d = max|x| / 32767: about 16 bits, finer than bf16's rounding; the block's exact fp32 sum is
kept for int4's mins); weights are widened to int16 as they are loaded, for vpmaddwd. The
weights keep servelm's int4 (w = s q + m per group of 32) or int8 (w = s q per row) values,
repacked in rows of 4 so one step streams them in order.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops
from servelm.quantization.formats import Int4Linear, Int8Linear
from servelm.quantization.numerics import unpack_int4

BLOCK = 32  # inputs per activation block; int4 needs weight groups of this size
ROWS = 4    # weight rows streamed together


def available() -> bool:
    """Whether the qdot kernels are built for this CPU (AVX2, FMA and F16C)."""
    return load_ops("qdot") and hasattr(torch.ops.servelm_qdot, "q4_linear")


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % ROWS
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] in 0..15, scales and mins float16 [N, K/32] -> (qweight uint8
    [N/4, K/32, 4, 16], scales float16 [N/4, K/32, 8]) in qdot.cpp's layout (rows padded to
    a multiple of 4 with zeros): byte i of row r's group g holds q[32g + i] low and
    q[32g + 16 + i] high; a group's scales are s of rows 0..3, then their m."""
    N, K = q.shape
    G = K // BLOCK
    q = _pad_rows(q.to(torch.uint8)).reshape(-1, ROWS, G, 2, 16)
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    s = _pad_rows(scales.to(torch.float16)).reshape(-1, ROWS, G).transpose(1, 2)
    m = _pad_rows(mins.to(torch.float16)).reshape(-1, ROWS, G).transpose(1, 2)
    return packed, torch.cat([s, m], dim=-1).contiguous()


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] in -127..127, scales [N] -> (qweight int8 [N/4, K/32, 4, 32], scales
    float32 [N/4 * 4]) in qdot.cpp's layout."""
    N, K = q.shape
    G = K // BLOCK
    packed = _pad_rows(q.to(torch.int8)).reshape(-1, ROWS, G, BLOCK).permute(0, 2, 1, 3)
    return packed.contiguous(), _pad_rows(scales.float().reshape(N)).contiguous()


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """An int4 layer with groups of 32 or an int8 layer, K a multiple of 32, on the CPU."""
    if act not in (torch.float32, torch.bfloat16) or src.in_features % BLOCK:
        return False
    if isinstance(src, Int4Linear):
        ok = src.group_size == BLOCK and src.qweight.device.type == "cpu"
    elif isinstance(src, Int8Linear):
        ok = src.qweight.device.type == "cpu"
    else:
        return False
    return ok and available()


class QDotLinear(nn.Module):
    """An int4 or int8 layer on qdot.cpp: activations quantised to int16 per block of 32 in
    the call, integer dot products, fp32 accumulation (fp32-accurate to ~1e-4 of
    the output's magnitude)."""

    packed_tensors = ("qweight", "scales", "bias")  # into huge pages (hugepages.pack_weights)

    def __init__(self, src: Int4Linear | Int8Linear):
        super().__init__()
        if not available():
            raise RuntimeError("the qdot kernels are not built for this CPU (AVX2, FMA, F16C)")
        self.in_features, self.out_features = src.in_features, src.out_features
        N = src.out_features
        if isinstance(src, Int4Linear):
            G = src.in_features // src.group_size
            q = unpack_int4(src.qweight, N)
            # Tiled [T, G, 16] -> per row [N, G].
            s = src.scales.transpose(1, 2).reshape(-1, G)[:N]
            m = src.mins.transpose(1, 2).reshape(-1, G)[:N]
            qw, sc = pack_q4(q, s, m)
            self._op = torch.ops.servelm_qdot.q4_linear.default
            self.bits = 4
        else:
            qw, sc = pack_q8(src.int8_weight(), src.scales[:N])
            self._op = torch.ops.servelm_qdot.q8_linear.default
            self.bits = 8
        self.register_buffer("qweight", qw)
        self.register_buffer("scales", sc)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self._op(x.float(), self.qweight, self.scales, self.out_features,
                            self.bias).to(x.dtype)
        return self._op(x, self.qweight, self.scales, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} x int16 activations")
