"""oneDNN weight prepacking for CPU linear layers, as a module swap.

`F.linear` on CPU hands oneDNN a plain row-major weight on every call, and oneDNN then
runs a path that streams it slowly: measured on the embedded model's 121 linear layers
(2 threads, benchmarks/kernels.py), bf16 at one row reads ~18 GB/s and fp32 matmuls at 512
rows reach ~0.23 TFLOP/s. The same weights reordered once into oneDNN's own blocked
layout (`mkldnn._reorder_linear_weight`, the format torch.compile's CPU freezing uses)
and run through `mkldnn._linear_pointwise` read ~35 GB/s at one row and run prefill-sized
matmuls close to the machine's matmul peak, in bf16 and in fp32.

`prepack_model(model)` swaps every `nn.Linear` for a `PackedLinear` holding only the
reordered weight (an opaque MKLDNN tensor). A tied LM head gets its own packed copy; the
embedding keeps the plain one (vocab x hidden extra elements). Results equal `F.linear`'s
to rounding (bf16: bit-identical in our tests; fp32: summation order, ~1e-6 relative).

It is the CPU fast path alongside the C++ kernels and is skipped where they are: CUDA,
dtypes oneDNN cannot pack here (fp16 without AVX512-FP16), quantised layers (already
swapped), and SERVELM_NO_KERNELS=1 (the eager reference); SERVELM_NO_PREPACK=1 turns off
only this (for side-by-side benchmarks).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from servelm.kernels import kernels_disabled


def prepack_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `prepack_model` would swap linear layers of this dtype on this device."""
    if torch.device(device).type != "cpu" or kernels_disabled():
        return False
    if os.environ.get("SERVELM_NO_PREPACK", "") not in ("", "0"):
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


@torch.no_grad()
def prepack_model(model: nn.Module) -> int:
    """Swap every CPU `nn.Linear` of a supported dtype for a `PackedLinear`, in place.

    Returns how many layers were swapped (0 when the dtype or device is not supported).
    Call it once the weights are final (loaded, sharded), before `pin_module_attributes`.
    """
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) is nn.Linear
             and prepack_supported(child.weight.dtype, child.weight.device)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def finalize_linears(model: nn.Module, quantization: str | None) -> nn.Module:
    """The linear layers as the engine runs them, once the weights are loaded (and
    sharded): quantised when asked (weight-only, any device), or on the CPU with the C++
    kernels, bf16/fp32 in the kernels' tiles (`TiledLinear`); either way on the CPU packed
    into huge pages in the order a step reads them. Every layer still a plain `nn.Linear`
    is prepacked for oneDNN where supported."""
    from servelm.quantization import pack_weights, quantize_model, tile_linears, tiles_supported

    if quantization:
        quantize_model(model, quantization)
        pack_weights(model)
    elif tiles_supported(model) and tile_linears(model):
        pack_weights(model)
    prepack_model(model)
    return model
