"""The "w8a8" linear method: int8 activations in blocks of up to 128 inputs times
per-channel int8 weights, with SmoothQuant's smoothing, on AVX-512 VNNI
(kernels/csrc/w8a8.cpp), for the compute-bound calls (prompts) of the layers a
calibration pass measured.

q8act quantises activations per block of 32 inputs against int4 weights with a scale and a
min per group of 32, and each block's fp32 scaling shares the vector pipes with its 8
integer multiply-adds, little faster than bf16 arithmetic. Here the weights are int8 with
one scale per output channel, so a block's int32 sums need only their activation scale,
once per up to 128 inputs (32 multiply-adds a row): close to the int8 dot product's own
rate (docs/kernels.md, "w8a8"). Longer activation blocks set a coarser step by their
largest input, so each
input channel j is first divided by s_j = amax_j^a / wmax_j^(1 - a) (amax_j: the channel's
largest |activation| over a calibration text, wmax_j: its weights' largest |w|; a = ALPHA)
and its weights multiplied by it (SmoothQuant): the same product, the activations'
outlier channels migrated into the weights, which are quantised per output channel after.
The division rides in the row's quantisation (no norm weights are rewritten, so o_proj,
whose input no norm precedes, takes it too).

Only layers with a calibration (`calibrated`, set by servelm.engine.calibration: qkv, o
and gate_up) take it; down_proj, whose inputs (after the gate) keep outliers the blocks
cannot hold, and the LM head stay on their methods (docs/kernels.md, "w8a8": the measured
KL of each choice). It runs bf16 activations only, where the CPU has AVX-512 VNNI
(int8_dot) and the kernel builds; the tuner may choose it for the prompt-sized bucket,
where it measures fastest, like any method.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from servelm.kernels import load_ops
from servelm.quantization.formats import fp32_weight

ALPHA = 0.65          # SmoothQuant's migration strength
AMAX = "act_amax"     # a source's calibration: fp32 [in_features], max |x| per input channel
_FLAGS = ("avx512_vnni",)  # the kernel's vpdpbusd (AMX-INT8 CPUs have it too)
BLOCKS = (128, 96, 64, 32, 16)  # activation block sizes: the largest dividing K is used


@functools.lru_cache(maxsize=1)
def int8_dot() -> bool:
    """Whether this CPU has the int8 dot product the kernel runs on (AVX-512 VNNI): without
    one the method stays out (the kernel is not built for it either)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return any(fl in flags for fl in _FLAGS)


def available() -> bool:
    """Whether the kernel is built here."""
    return load_ops("w8a8") and hasattr(torch.ops.servelm_w8a8, "linear")


def calibrated(src: nn.Module) -> torch.Tensor | None:
    """The source's calibration (max |x| per input channel), or None."""
    return getattr(src, AMAX, None)


def block_size(k: int) -> int:
    """The activation block for in_features k: the largest of BLOCKS dividing it (0: none)."""
    return next((b for b in BLOCKS if k % b == 0), 0)


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """A calibrated layer with bf16 activations and in_features a multiple of 16, where the
    CPU has AVX-512 VNNI and the kernel builds (the registry asks only for CPU layers:
    LinearMethod.applies)."""
    return (act == torch.bfloat16 and calibrated(src) is not None
            and block_size(src.in_features) > 0 and int8_dot() and available())


def smoothing(amax: torch.Tensor, w: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s [K] for activations of channel maxima amax
    [K] and weights w [N, K] (fp32)."""
    wmax = w.abs().amax(0).clamp_min(1e-5)
    return (amax.float().clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)).clamp_min(1e-5)


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (int8 [N, K], scale fp32 [N]): symmetric, per output channel."""
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's panels, uint8 [ceil(N / 16), K / 4, 16, 4]: byte (k4, o, t)
    holds q[o, 4 k4 + t] + 128 (VNNI multiplies unsigned bytes by signed ones), the rows past
    N zeros (never stored)."""
    n, k = q.shape
    pad = -n % 16
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    if pad:
        u = torch.cat([u, torch.full((pad, k), 128, dtype=torch.uint8)])
    return u.reshape(-1, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def reference(x: torch.Tensor, inv: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to rows x [M, K] (fp32 arithmetic): (q int8 [M, K], d fp32
    [M, K / block]), x * inv ~ q * d (each block's d)."""
    a = (x.float() * inv).reshape(*x.shape[:-1], -1, block)
    amax = a.abs().amax(-1, keepdim=True)
    q = torch.round(a * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return q.to(torch.int8).reshape(x.shape), (amax / 127.0).squeeze(-1)


class W8A8Linear(nn.Module):
    """A calibrated layer on w8a8.cpp: its weights (the source's, dequantised: int4, int8 or
    plain) smoothed and quantised per output channel to int8, in the kernel's panels (an
    int8 copy, twice an int4 layer's bytes: the tuner counts it as a dequantised copy),
    1 / s and the bias in fp32."""

    packed_tensors = ("weight", "weight_scale", "inv_scale", "bias")
    compute_dtype = torch.bfloat16
    # The known-answer check's bound on |error| / max |output| (servelm.tuning): a block's
    # int8 step is set by its largest input, a coarser step than q8act's per 32 inputs
    # (docs/kernels.md, "w8a8": what real layers read). A broken kernel is off by the
    # output's own magnitude.
    check_tolerance = 0.06

    def __init__(self, src: nn.Module, alpha: float | None = None):
        super().__init__()
        if not available():
            raise RuntimeError("the w8a8 kernel is not built here (AVX-512 VNNI)")
        amax = calibrated(src)
        if amax is None:
            raise ValueError("w8a8 needs the layer's calibration (its activations' maxima)")
        self.in_features, self.out_features = src.in_features, src.out_features
        w = fp32_weight(src)
        alpha = ALPHA if alpha is None else alpha
        s = smoothing(amax, w, alpha)
        q, scale = quantize_channels(w * s)
        self.block = block_size(self.in_features)
        self.register_buffer("weight", pack(q))
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("inv_scale", (1.0 / s).float().contiguous())
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self._op = torch.ops.servelm_w8a8.linear.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.inv_scale, self.weight, self.weight_scale, self.block,
                        self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 x int8 activations per block of {self.block}, smoothed")
