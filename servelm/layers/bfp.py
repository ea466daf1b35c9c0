"""The "bfp" linear method: bf16 layers (with bf16 activations) and int8 layers on AVX2
integer multiply-adds, as block floating point (kernels/csrc/bfp.cpp; AVX2 + FMA + F16C).

Packing cuts each output's weights into blocks of 64 inputs sharing one power-of-two
exponent, each weight an int16 mantissa of 12 bits and a sign; each call does the same to
its activation rows (13 bits), sums a block's 64 products exactly in int32 by `vpmaddwd`
(16 multiplications a vector, twice an fp32 FMA's), then chains the blocks in fp32. A bf16
weight at least 1/16 of its block's largest (an activation: 1/32) is exact; smaller ones
are rounded by at most 2^-12 (2^-13) of the largest, far below bf16's own rounding of the
block's large values, so the result is the bf16 dot product to within bf16's output
rounding. Each row is quantised and reduced on its own, in order: its bits do not depend on
the row count. It exists for CPUs without AVX512-BF16, where bf16 prompts and batches
otherwise run at the fp32 FMA peak (the panels kernel); the tuner takes it where it
measures faster.

An int8 layer's codes (w = s q) are already integer mantissas: they go into the same panels
as int8 (a byte a weight, sign-extended as the kernel reads them), each output's s as every
block's scale, and the activations get 15-bit mantissas a block, finer than bf16 (qdot's
int16 activations are likewise allowed in fp32 runs).
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.kernels import load_ops

NR = 16     # outputs per panel
BLOCK = 64  # inputs per block (one exponent each side)
W_BITS = 12  # weight mantissas: |q| < 2^12
X_BITS = 13  # activation mantissas: |q| <= 2^13 (bf16 weights)
X8_BITS = 15  # activation mantissas: |q| < 2^15 (int8 weights)
TINY = 2.0 ** -100  # a block whose largest magnitude is below this is zero


def available() -> bool:
    """Whether the bfp kernel is built for this CPU (AVX2, FMA and F16C)."""
    return load_ops("bfp") and hasattr(torch.ops.servelm_bfp, "linear")


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """A bf16 nn.Linear on the CPU with bf16 activations, or an int8 layer on the CPU with
    fp32 or bf16 activations."""
    from servelm.quantization.formats import Int8Linear

    if isinstance(src, Int8Linear):
        return (act in (torch.float32, torch.bfloat16) and src.qweight.device.type == "cpu"
                and available() and hasattr(torch.ops.servelm_bfp, "pack_int8"))
    return (isinstance(src, nn.Linear) and src.weight.dtype == torch.bfloat16
            and act == torch.bfloat16 and src.weight.device.type == "cpu" and available())


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., Kp / 64, 64] in fp32, K padded with zeros to a multiple of 64."""
    k = t.shape[-1]
    t = torch.nn.functional.pad(t.float(), (0, (-k) % BLOCK))
    return t.reshape(*t.shape[:-1], -1, BLOCK)


def _pow2_scale(amax: torch.Tensor, bits: int) -> torch.Tensor:
    """2^(floor(log2 amax) + 1 - bits) (amax > 0): amax / scale lies in [2^(bits-1), 2^bits)."""
    _, e = torch.frexp(amax)
    return torch.ldexp(torch.ones_like(amax), (e - bits).to(torch.int32))


def pack_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What servelm_bfp.pack makes of weight [N, K] (finite): (wq int16 [ceil(N / 16), Kp / 2,
    16, 2], ws fp32 [ceil(N / 16), Kp / 64, 16])."""
    n, _ = weight.shape
    wb = _blocks(torch.nn.functional.pad(weight.detach(), (0, 0, 0, (-n) % NR)))
    amax = wb.abs().amax(-1, keepdim=True)
    live = amax >= TINY  # smaller blocks are zero
    scale = torch.where(live, _pow2_scale(amax, W_BITS), torch.zeros_like(amax))
    q = torch.where(live, torch.round(wb / torch.where(live, scale, 1.0)), 0.0)
    q = q.clamp(-(2 ** W_BITS - 1), 2 ** W_BITS - 1).to(torch.int16)  # [N16, B, 64]
    n16, nb = q.shape[:2]
    wq = q.reshape(n16 // NR, NR, nb * BLOCK // 2, 2).transpose(1, 2).contiguous()
    ws = scale.squeeze(-1).reshape(n16 // NR, NR, nb).transpose(1, 2).contiguous()
    return wq, ws


def quantize_reference(x: torch.Tensor, int8_weights: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """What servelm_bfp.quantize makes of x [..., K] (finite): (q int16 [M, Kp], d fp32
    [M, Kp / 64]); the kernel computes x' @ w'.T for x' = q * d and w' = wq * ws."""
    xb = _blocks(x.reshape(-1, x.shape[-1]))
    amax = xb.abs().amax(-1, keepdim=True)
    live = amax >= TINY
    bits, lim = (X8_BITS, 2 ** X8_BITS - 1) if int8_weights else (X_BITS, 2 ** X_BITS)
    d = torch.where(live, _pow2_scale(amax, bits), torch.zeros_like(amax))
    q = torch.where(live, torch.round(xb / torch.where(live, d, 1.0)), 0.0).clamp(-lim, lim)
    return q.to(torch.int16).reshape(q.shape[0], -1), d.squeeze(-1)


class BfpLinear(nn.Module):
    """A bf16 or int8 linear layer on bfp.cpp, in panels of 16 outputs with one fp32 scale per
    output and block of 64 inputs, the bias in fp32; the output in the activations' dtype.
    bf16 weights become int16 block mantissas with power-of-two scales (2 bytes a weight, as
    bf16; bf16 activations). An int8 layer's codes are its mantissas, a byte a weight
    (widened as they are read), its per-output scale every block's (fp32 or bf16
    activations, 15-bit mantissas a block)."""

    packed_tensors = ("wq", "ws", "bias")  # into huge pages (hugepages.pack_weights)

    def __init__(self, src: nn.Module):
        from servelm.quantization.formats import Int8Linear

        super().__init__()
        if not available():
            raise RuntimeError("the bfp kernel is not built for this CPU (AVX2, FMA, F16C)")
        self.in_features, self.out_features = src.in_features, src.out_features
        if isinstance(src, Int8Linear):
            wq, ws = torch.ops.servelm_bfp.pack_int8(src.int8_weight(),
                                                     src.scales[: src.out_features].float())
        else:
            wq, ws = torch.ops.servelm_bfp.pack(src.weight.detach())
            # the known-answer check's tolerance: bf16's, not fp32's
            self.compute_dtype = torch.bfloat16
        self.register_buffer("wq", wq)
        self.register_buffer("ws", ws)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_bfp.linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.wq, self.ws, self.out_features, self.bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weights [N, K] this layer computes with: each block's mantissas times its
        scale (a bf16 source's values where its block's exponents span the mantissa's
        spare bits)."""
        p, a, r, g = self.wq.shape  # [ceil(N / 16), Kp / g, 16, g]
        q = self.wq.permute(0, 2, 1, 3).reshape(p * r, a * g).double()  # (products exact)
        scale = self.ws.permute(0, 2, 1).reshape(p * r, -1).double().repeat_interleave(BLOCK, dim=1)
        return (q * scale)[: self.out_features, : self.in_features].to(dtype)

    def extra_repr(self) -> str:
        kind = "int8 x int16" if self.wq.dtype == torch.int8 else "bf16 as int16"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{kind} blocks of {BLOCK} (AVX2)")
