"""The "amx" linear method: bf16 layers on servelm's AMX tile kernel
(kernels/csrc/amx_linear.cpp); int4 and int8 layers too, their weights dequantised once to
bf16 (as the onednn method does: a batch of rows is compute-bound, and AMX multiplies bf16).
The weight is packed once into tile order (pairs of 16-column
blocks, a contiguous stream each); a call runs its rows in blocks (up to 32 rows on tiles of
exactly its rows, more in blocks of 32) against each pair, with fp32 sums in AMX tiles rounded
once to bf16. A SwiGLU MLP's gate_up layer is packed with its gate and up blocks alternating
(gate_silu) and writes silu(gate) * up directly (the MLP's separate SiLU pass over a
[rows, 2 x intermediate] product, 6% of a 512-token prompt's time, is gone). Each row's
result depends on that row only, so the method is batch-invariant. The tuner chooses it per
layer shape and row bucket where it measures faster than the other methods (oneDNN's own AMX
path among them).
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops
from servelm.quantization.formats import Int4Linear, Int8Linear


def available() -> bool:
    """Whether the kernel is built and may run here (an AMX-BF16 CPU whose OS grants the
    tile state)."""
    return load_ops("amx_linear") and bool(torch.ops.servelm_amx_linear.available())


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """A bf16 nn.Linear, or an int4 / int8 layer, on the CPU with bf16 activations, in and
    out features multiples of 32 (the tiles' K step and column pair), where the kernel
    runs."""
    if isinstance(src, nn.Linear):
        ok = src.weight.dtype == torch.bfloat16 and src.weight.device.type == "cpu"
    else:
        ok = isinstance(src, (Int4Linear, Int8Linear)) and src.qweight.device.type == "cpu"
    return (ok and act == torch.bfloat16 and src.in_features % 32 == 0
            and src.out_features % 32 == 0 and available())


class AmxLinear(nn.Module):
    """A bf16 linear layer on amx_linear.cpp: the weight in tile order (the source's own
    weight is not kept; an int4 / int8 source's dequantised to bf16 first), the bias in
    fp32."""

    def __init__(self, src: nn.Module):
        super().__init__()
        if not available():
            raise RuntimeError("the AMX linear kernel does not run here (no AMX-BF16)")
        self.in_features, self.out_features = src.in_features, src.out_features
        ops = torch.ops.servelm_amx_linear
        w = (src.weight.detach() if isinstance(src, nn.Linear)
             else src.dequantize(torch.bfloat16).contiguous())
        self.register_buffer("packed", ops.pack(w))
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().contiguous())
        self._op = ops.linear.default
        self.gated = False  # gate_silu(): the weight's gate and up blocks alternate

    @property
    def writes_silu_mul(self) -> bool:
        """Whether silu_mul runs (GatedMLP.select takes it): once gate_silu() has gated it."""
        return self.gated

    @torch.no_grad()
    def gate_silu(self) -> None:
        """Make this layer, a SwiGLU MLP's fused [gate; up] projection, run silu(gate) * up
        in its epilogue (silu_mul): its 16-output blocks reordered in place so that each
        column pair is a gate block and the up block of the same features (the kernel's
        gated_linear). forward() still returns gate_up in the source's order."""
        if self.gated:
            return
        n, k = self.out_features, self.in_features
        pairs, ksteps = n // 32, k // 32
        # New block 2q + h (h: 0 gate, 1 up) is source block q + h * pairs.
        order = torch.arange(pairs).view(pairs, 1) + torch.tensor([0, pairs])
        order = order.reshape(-1)
        blocks = (self.packed.view(pairs, ksteps, 2, 256).permute(0, 2, 1, 3)
                  .reshape(2 * pairs, ksteps, 256))
        self.packed = (blocks[order].view(pairs, 2, ksteps, 256).permute(0, 2, 1, 3)
                       .contiguous().view(-1))
        if self.bias is not None:
            self.bias = self.bias.view(2 * pairs, 16)[order].reshape(-1).contiguous()
        self.gated = True
        self._gated_op = torch.ops.servelm_amx_linear.gated_linear.default

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate_silu() layer: [.., out_features / 2], the same bits
        as forward() followed by servelm_ops.silu_and_mul."""
        return self._gated_op(x, self.packed, self.bias, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._op(x, self.packed, self.bias, self.out_features)
        if self.gated:  # back to [gate; up]: block 2q + h to h * pairs + q
            y = y.view(*y.shape[:-1], -1, 2, 16).transpose(-2, -3).reshape(y.shape)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bf16 AMX tiles"
                + (", SiLU-gated" if self.gated else ""))
