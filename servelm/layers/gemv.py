"""The "gemv" linear method: fp32 and bf16 layers for a few activation rows on servelm's
AVX2 + FMA kernel (kernels/csrc/gemv.cpp) over the layer's own row-major weight (no copy).
Decode reads every weight once a step; this streams 4 weight rows at a time against two
activation rows (bf16 weights widened to fp32 as they are read, summed in fp32); "gemv_rows"
reads the same weight a row after another, one sequential stream (faster for short rows on
some CPUs, slower for long ones). The tuner chooses either per row bucket where it measures
faster than oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops


def available() -> bool:
    """Whether the gemv kernel is built for this CPU (AVX2 and FMA)."""
    return load_ops("gemv") and hasattr(torch.ops.servelm_gemv, "bf16_linear")


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """An fp32 or bf16 nn.Linear on the CPU with activations of its dtype, in_features a
    multiple of 8."""
    return (isinstance(src, nn.Linear) and src.weight.dtype == act
            and act in (torch.float32, torch.bfloat16) and src.weight.device.type == "cpu"
            and src.in_features % 8 == 0 and available())


class GemvLinear(nn.Module):
    """An fp32 or bf16 linear layer on gemv.cpp, sharing the source layer's weight and bias
    (the output in the activations' dtype)."""

    def __init__(self, src: nn.Linear, by_row: bool = False):
        super().__init__()
        self.by_row = by_row
        if not available():
            raise RuntimeError("the gemv kernel is not built for this CPU (AVX2, FMA)")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.register_buffer("weight", src.weight.detach().contiguous())
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float())
        ops = torch.ops.servelm_gemv
        self._op = (ops.bf16_linear if self.weight.dtype == torch.bfloat16
                    else ops.f32_linear).default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # activations of the weight's dtype (applies); any other is the op's clear error
        return self._op(x, self.weight, self.bias, self.by_row)

    def extra_repr(self) -> str:
        kind = "bf16" if self.weight.dtype == torch.bfloat16 else "fp32"
        order = ", by row" if self.by_row else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{kind} AVX2{order}")
