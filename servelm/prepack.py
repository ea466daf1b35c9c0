"""oneDNN weight prepacking for CPU linear layers (the "onednn" linear method).

`F.linear` on CPU hands oneDNN a plain row-major weight on every call, and oneDNN then
runs a path that streams it slowly: measured on the embedded model's 121 linear layers
(2 threads, benchmarks/kernels.py), bf16 at one row reads ~18 GB/s and fp32 matmuls at 512
rows reach ~0.23 TFLOP/s. The same weights reordered once into oneDNN's own blocked
layout (`mkldnn._reorder_linear_weight`, the format torch.compile's CPU freezing uses)
and run through `mkldnn._linear_pointwise` read ~35 GB/s at one row and run prefill-sized
matmuls close to the machine's matmul peak, in bf16 and in fp32.

A `PackedLinear` holds only the reordered weight (an opaque MKLDNN tensor); a tied LM head
gets its own packed copy, the embedding keeps the plain one. Results equal `F.linear`'s
to rounding (bf16: bit-identical in our tests; fp32: summation order, ~1e-6 relative).

It is one of the linear methods servelm.tuning chooses from ("onednn"): where the CPU has
AMX, oneDNN runs prompt-sized and batched matmuls on it. CPU only, and only for dtypes
oneDNN can pack here (fp32; bf16 where the CPU multiplies it natively).
"""

from __future__ import annotations

import torch
from torch import nn


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN can prepack linear layers of this dtype on this device."""
    if torch.device(device).type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout (CPU, fp32 or bf16)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        # batch_size None: one layout for every row count (a hint of 1 or 64 measured no
        # better at its own size and worse at the other).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        bias = linear.bias
        self.bias = None if bias is None else bias.detach().to(w.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.dtype}, oneDNN prepacked")
