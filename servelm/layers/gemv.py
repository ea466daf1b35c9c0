"""The "gemv" linear method: fp32 layers for a few activation rows on servelm's AVX2 + FMA
kernel (kernels/csrc/gemv.cpp) over the layer's own row-major weight (no copy). Decode reads
every weight once a step; this streams 4 weight rows at a time against two activation rows.
The tuner chooses it per row bucket where it measures faster than oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops


def available() -> bool:
    """Whether the gemv kernel is built for this CPU (AVX2 and FMA)."""
    return load_ops("gemv") and hasattr(torch.ops.servelm_gemv, "f32_linear")


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """An fp32 nn.Linear on the CPU with fp32 activations, in_features a multiple of 8."""
    return (isinstance(src, nn.Linear) and src.weight.dtype == torch.float32
            and act == torch.float32 and src.weight.device.type == "cpu"
            and src.in_features % 8 == 0 and available())


class GemvLinear(nn.Module):
    """An fp32 linear layer on gemv.cpp, sharing the source layer's weight and bias."""

    def __init__(self, src: nn.Linear):
        super().__init__()
        if not available():
            raise RuntimeError("the gemv kernel is not built for this CPU (AVX2, FMA)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.register_buffer("weight", src.weight.detach().contiguous())
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float())
        self._op = torch.ops.servelm_gemv.f32_linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 activations (applies); any other dtype is the op's clear error
        return self._op(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32 AVX2"
