"""The "panels" linear method: fp32 and bf16 layers for any row count on servelm's AVX2 + FMA
GEMM kernel (kernels/csrc/panels.cpp), over the weight packed once into panels of 16 output
columns, k-major ([ceil(N / 16), K, 16], the weight's own dtype: bf16 stays 2 bytes a
weight). The kernel keeps 6 activation rows x 16 outputs in registers, so it wins where
oneDNN's fp32 matmul loses most (a few rows up to a batch); bf16 weights are widened as they
are read. Each output is one fused multiply-add chain over k in order, so its bits do not
depend on the row count (row-invariant). The tuner chooses it per row bucket where it
measures faster.

int4 layers (Int4Linear) run on the same kernel from panels of nibbles: each K block of a
panel is decoded to fp32 in L1 once per call (per 96-row block) and multiplied as an fp32
panel, so a prompt or a batch pays the decoding once for all its rows and then runs at the
fp32 FMA rate (servelm's integer kernels multiply every row by a weight widened for it);
calls of 1-4 rows decode in registers instead. The decoded weights are dequantize_int4's
fp32 values, bit for bit, on either path. int8 layers
(Int8Linear) likewise, from panels of int8 and their per-output scales (q * s:
dequantize_int8's values), always through the block buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels import load_ops

NR = 16  # output columns per panel (the kernel's two AVX2 vectors)


def available() -> bool:
    """Whether the panels kernel is built for this CPU (AVX2 and FMA)."""
    return load_ops("panels") and hasattr(torch.ops.servelm_panels, "linear")


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """An fp32 or bf16 nn.Linear on the CPU with activations of its dtype, or an int4 or int8
    layer on the CPU with fp32 or bf16 activations."""
    from servelm.quantization.formats import Int4Linear, Int8Linear

    if isinstance(src, (Int4Linear, Int8Linear)):
        op = "int4_linear" if isinstance(src, Int4Linear) else "int8_linear"
        return (act in (torch.float32, torch.bfloat16) and src.qweight.device.type == "cpu"
                and available() and hasattr(torch.ops.servelm_panels, op))
    return (isinstance(src, nn.Linear) and src.weight.dtype == act
            and act in (torch.float32, torch.bfloat16) and src.weight.device.type == "cpu"
            and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] in the weight's dtype, the columns past N zero."""
    n, k = weight.shape
    pad = (-n) % NR
    w = F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight.detach()
    return w.reshape(-1, NR, k).transpose(1, 2).contiguous()


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [16T, K] in 0..15 (rows padded to 16) -> [T, K, 8]: byte j of row k holds
    column 16t + j in its low nibble and 16t + j + 8 in its high one."""
    n16, k = q.shape
    q = q.reshape(n16 // NR, NR, k).transpose(1, 2)
    return (q[..., :8] | (q[..., 8:] << 4)).contiguous()


class PanelLinear(nn.Module):
    """An fp32 or bf16 linear layer on panels.cpp: the weight packed into panels (a copy in
    the weight's dtype), the bias in fp32; the output in the activations' dtype."""

    packed_tensors = ("panels", "bias")  # into huge pages (hugepages.pack_weights)

    def __init__(self, src: nn.Linear):
        super().__init__()
        if not available():
            raise RuntimeError("the panels kernel is not built for this CPU (AVX2, FMA)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.register_buffer("panels", pack(src.weight))
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_panels.linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # activations of the weight's dtype (applies); any other is the op's clear error
        return self._op(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        kind = "bf16" if self.panels.dtype == torch.bfloat16 else "fp32"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{kind} AVX2 panels")


class Int4PanelLinear(nn.Module):
    """An int4 layer on panels.cpp: the nibbles repacked into panels (4 bits a weight), the
    group scales and mins shared with the source (float16 [ceil(N / 16), K / G, 16]: already
    a panel's 16 outputs together), the bias in fp32; the output in the activations' dtype."""

    packed_tensors = ("qpanels", "scales", "mins", "bias")

    def __init__(self, src):
        from servelm.quantization.numerics import unpack_int4

        super().__init__()
        if not available():
            raise RuntimeError("the panels kernel is not built for this CPU (AVX2, FMA)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.group_size = src.group_size
        self.register_buffer("qpanels", pack_q4(unpack_int4(src.qweight)))
        self.register_buffer("scales", src.scales)
        self.register_buffer("mins", src.mins)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_panels.int4_linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.qpanels, self.scales, self.mins, self.group_size,
                        self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 AVX2 panels, group_size={self.group_size}")


class Int8PanelLinear(nn.Module):
    """An int8 layer on panels.cpp: q int8 in panels ([ceil(N / 16), K, 16], a byte a weight)
    with its fp32 per-output scales (zeros past N), the bias in fp32; the output in the
    activations' dtype."""

    packed_tensors = ("qpanels", "scales", "bias")

    def __init__(self, src):
        super().__init__()
        if not available():
            raise RuntimeError("the panels kernel is not built for this CPU (AVX2, FMA)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.register_buffer("qpanels", pack(src.int8_weight()))
        n = src.out_features
        scales = torch.zeros(self.qpanels.shape[0] * NR, dtype=torch.float32)
        scales[:n] = src.scales[:n].float()
        self.register_buffer("scales", scales)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_panels.int8_linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.qpanels, self.scales, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 AVX2 panels")
