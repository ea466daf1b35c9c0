"""The "w8a8" linear method: int8 activations in blocks of up to 128 inputs times int8
weights scaled per output channel and block, with SmoothQuant's smoothing, on AVX-512 VNNI
(kernels/csrc/w8a8.cpp; AVX-VNNI's 256-bit vectors on CPUs without AVX-512), for the
compute-bound calls (prompts) of the layers a calibration pass measured.

q8act quantises activations per block of 32 inputs against int4 weights with a scale and a
min per group of 32, and each block's fp32 scaling shares the vector pipes with its 8
integer multiply-adds, little faster than bf16 arithmetic. Here the weights are int8 with
one scale per output channel and activation block, so a block's int32 sums are scaled once
per up to 128 inputs (32 multiply-adds a row): close to the int8 dot product's own rate
(docs/kernels.md, "w8a8"). Longer activation blocks set a coarser step by their largest
input, so each input channel j is first divided by s_j = amax_j^a / wmax_j^(1 - a) (amax_j:
the channel's largest |activation| over a calibration text, wmax_j: its weights' largest
|w|; a = ALPHA) and its weights multiplied by it (SmoothQuant): the same product, the
activations' outlier channels migrated into the weights, which are quantised after, each
block of an output channel to its own scale (so the migrated channels coarsen only their
block's step). The division rides in the row's quantisation (no norm weights are
rewritten, so o_proj and down_proj, whose inputs no norm precedes, take it too).

Only layers with a calibration (`calibrated`, set by servelm.engine.calibration: qkv, o,
gate_up and down) take it; the LM head stays on its method (docs/kernels.md, "w8a8": the
measured KL of each choice). It runs bf16 activations only, where the CPU has AVX-512 VNNI
(int8_dot) and the kernel builds; the tuner may choose it for the prompt-sized bucket,
where it measures fastest, like any method.

On AVX-512 VNNI the same weights and arithmetic also run two panels (32 outputs) a
micro-kernel call ("w8a8_pairs": W8A8Linear(src, pairs=True), w8a8_kernel.h's pairs: the same
bits): twice the independent sums per step and one row broadcast for two products, for cores
that retire two 512-bit vpdpbusd a cycle. On CPUs with AMX-INT8 they run on tiles ("w8a8_amx":
W8A8Linear(src, tiles=True), kernels/csrc/w8a8_tiles.h: the same bits). The tuner measures each
form beside the VNNI one.

On CUDA the same weights and arithmetic run on int8 tensor cores (W8A8TritonLinear:
servelm.kernels.triton_quant's w8a8 kernels), where servelm.tuning_cuda measures it faster
than the layer's own kernel.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from servelm.kernels import load_ops
from servelm.quantization.formats import fp32_weight

ALPHA = 0.65          # SmoothQuant's migration strength
AMAX = "act_amax"     # a source's calibration: fp32 [in_features], max |x| per input channel
LONGEST = "act_block"  # a source's longest activation block, where its calibration set one
# The kernel's vpdpbusd: AVX-512 VNNI (AMX-INT8 CPUs have it too), or AVX-VNNI's 256-bit
# form (w8a8_kernel.h's w8a8_256, on CPUs without AVX-512).
_FLAGS = ("avx512_vnni", "avx_vnni")
BLOCKS = (128, 96, 64, 32, 16)  # activation block sizes: the largest dividing K is used


_TILE_FLAG = "amx_int8"  # AMX's int8 tile products (tdpbsud), the tile form's
# The tile form's op: linear_tiles (the tests of a machine without AMX run
# linear_tiles_emulated, the same loop on tiles emulated in C++).
TILE_OP = "linear_tiles"
PAIR_OP = "linear_pairs"  # the pair form's op (AVX-512 VNNI)
PAIR_SILU_OP = "linear_pairs_silu"  # ... a SwiGLU gate_up's, SiLU in its epilogue (+ AVX512-BF16)


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return []


@functools.lru_cache(maxsize=1)
def int8_dot() -> bool:
    """Whether this CPU has the int8 dot product the kernel runs on (AVX-512 VNNI, or
    AVX-VNNI): without one the method stays out (the kernel is not built for it either)."""
    return any(fl in _cpu_flags() for fl in _FLAGS)


@functools.lru_cache(maxsize=1)
def int8_tiles() -> bool:
    """Whether this CPU has AMX-INT8, the tile form's instructions."""
    return _TILE_FLAG in _cpu_flags()


def available() -> bool:
    """Whether the kernel is built here."""
    return load_ops("w8a8") and hasattr(torch.ops.servelm_w8a8, "linear")


def tiles_available() -> bool:
    """Whether the tile form is built here (the compiler targets AMX-INT8) and the OS grants
    this process AMX's tile state."""
    return (available() and hasattr(torch.ops.servelm_w8a8, "tiles_available")
            and bool(torch.ops.servelm_w8a8.tiles_available()))


def calibrated(src: nn.Module) -> torch.Tensor | None:
    """The source's calibration (max |x| per input channel), or None."""
    return getattr(src, AMAX, None)


def longest_block(src: nn.Module) -> int:
    """The longest activation block the source's calibration allows (BLOCKS[0] unless it set
    a shorter one: down_proj, servelm.engine.calibration.TARGETS)."""
    return getattr(src, LONGEST, BLOCKS[0])


def set_calibration(src: nn.Module, amax: torch.Tensor, longest: int = BLOCKS[0]) -> None:
    """Gives the source its calibration: channel maxima amax [in_features] and the longest
    activation block its rows are quantised in."""
    setattr(src, AMAX, amax)
    if longest != BLOCKS[0]:
        setattr(src, LONGEST, longest)
    elif hasattr(src, LONGEST):
        delattr(src, LONGEST)


def block_size(k: int, longest: int = BLOCKS[0]) -> int:
    """The activation block for in_features k: the largest of BLOCKS up to `longest` dividing
    it (0: none)."""
    return next((b for b in BLOCKS if b <= longest and k % b == 0), 0)


def layer_block(src: nn.Module) -> int:
    """The activation block of a calibrated source (0: none fits its in_features)."""
    return block_size(src.in_features, longest_block(src))


def applies(src: nn.Module, act: torch.dtype) -> bool:
    """A calibrated layer with bf16 activations and in_features a multiple of 16, where the
    CPU has AVX-512 VNNI and the kernel builds (the registry asks only for CPU layers:
    LinearMethod.applies)."""
    return (act == torch.bfloat16 and calibrated(src) is not None
            and layer_block(src) > 0 and int8_dot() and available())


def pairs_available() -> bool:
    """Whether the pair form is built here (AVX-512 VNNI: not on AVX-VNNI's 256-bit form)."""
    return available() and hasattr(torch.ops.servelm_w8a8, PAIR_OP)


def pairs_apply(src: nn.Module, act: torch.dtype) -> bool:
    """The pair form's conditions: applies', where the pair form is built."""
    return applies(src, act) and pairs_available()


def tiles_apply(src: nn.Module, act: torch.dtype) -> bool:
    """The tile form's conditions: applies', on a CPU with AMX-INT8 where the form runs."""
    return applies(src, act) and int8_tiles() and tiles_available()


def smoothing(amax: torch.Tensor, w: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s [K] for activations of channel maxima amax
    [K] and weights w [N, K] (fp32)."""
    wmax = w.abs().amax(0).clamp_min(1e-5)
    return (amax.float().clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)).clamp_min(1e-5)


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] fp32 -> (int8 [N, K], scale fp32 [N, K / block]): symmetric, per output channel
    and block of `block` inputs (the activations' blocks, so the kernel scales each block's
    int32 sums once: the smoothing's large factors coarsen only their own block's step)."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block)
    scale = (wb.abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.round(wb / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale.float()


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, NB] -> the kernel's [ceil(N / 16), NB, 16] (panel, block, column), the
    columns past N zeros."""
    n, nb = scale.shape
    pad = -n % 16
    if pad:
        scale = torch.cat([scale, scale.new_zeros(pad, nb)])
    return scale.reshape(-1, 16, nb).permute(0, 2, 1).contiguous()


def unpack_scales(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_scales' inverse: fp32 [out_features, NB]."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:out_features]


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


@torch.no_grad()
def smoothed(src: nn.Module, alpha: float | None = None):
    """A calibrated source's operands: (block, q int8 [N, K], scale fp32 [N, K / block],
    1 / s fp32 [K], bias fp32 [N] or None): its weights (dequantised) times the smoothing s,
    quantised per output channel and activation block, on the source's device."""
    amax = calibrated(src)
    if amax is None:
        raise ValueError("w8a8 needs the layer's calibration (its activations' maxima)")
    w = fp32_weight(src)
    s = smoothing(amax.to(w.device), w, ALPHA if alpha is None else alpha)
    block = layer_block(src)
    if not block:
        raise ValueError(f"w8a8: no activation block divides in_features {src.in_features}")
    q, scale = quantize_blocks(w * s, block)
    b = src.bias
    return (block, q, scale, (1.0 / s).float().contiguous(),
            None if b is None else b.detach().float().clone())


class W8A8Linear(nn.Module):
    """A calibrated layer on w8a8.cpp: its weights (the source's, dequantised: int4, int8 or
    plain) smoothed and quantised to int8 per output channel and activation block (their
    scales in pack_scales' order), in the kernel's panels (an
    int8 copy, twice an int4 layer's bytes: the tuner counts it as a dequantised copy),
    1 / s and the bias in fp32. pairs: run two panels a micro-kernel call (the same bits);
    tiles: run on AMX-INT8 tiles (the same bits; the DecodeStack leaves such a layer to the
    per-op path)."""

    packed_tensors = ("weight", "weight_scale", "inv_scale", "bias")
    compute_dtype = torch.bfloat16
    # The known-answer check's bound on |error| / max |output| (servelm.tuning): a block's
    # int8 step is set by its largest input, a coarser step than q8act's per 32 inputs
    # (docs/kernels.md, "w8a8": what real layers read). A broken kernel is off by the
    # output's own magnitude.
    check_tolerance = 0.06

    def __init__(self, src: nn.Module, alpha: float | None = None, tiles: bool = False,
                 pairs: bool = False):
        super().__init__()
        if tiles and pairs:
            raise ValueError("w8a8: the tile form or the pair form, not both")
        if not available():
            raise RuntimeError("the w8a8 kernel is not built here (AVX-512 VNNI or AVX-VNNI)")
        if tiles and not tiles_available():
            raise RuntimeError("w8a8's tile form does not run here (AMX-INT8)")
        if pairs and not pairs_available():
            raise RuntimeError("w8a8's pair form does not run here (AVX-512 VNNI)")
        self.tiles, self.pairs = tiles, pairs
        self.in_features, self.out_features = src.in_features, src.out_features
        self.block, q, scale, inv, bias = smoothed(src, alpha)
        self.register_buffer("weight", pack(q))
        self.register_buffer("weight_scale", pack_scales(scale))
        self.register_buffer("inv_scale", inv)
        self.register_buffer("bias", bias)
        ops = torch.ops.servelm_w8a8
        self._op = getattr(ops, TILE_OP if tiles else PAIR_OP if pairs else "linear").default
        # The pair form can write a SwiGLU gate_up's silu(gate) * up itself (silu_mul):
        # GatedMLP.select takes it for a SiLU MLP's gate_up, its output [gate; up] halves of
        # whole panels and no bias.
        self.writes_silu_mul = (pairs and hasattr(ops, PAIR_SILU_OP) and bias is None
                                and self.out_features % 32 == 0)
        self._silu_op = getattr(ops, PAIR_SILU_OP).default if self.writes_silu_mul else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.inv_scale, self.weight, self.weight_scale, self.block,
                        self.out_features, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer as a SwiGLU gate_up ([gate; up]; writes_silu_mul):
        [.., out_features / 2], the bits of forward() then servelm_ops.silu_and_mul."""
        return self._silu_op(x, self.inv_scale, self.weight, self.weight_scale, self.block,
                             self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 x int8 activations per block of {self.block}, smoothed"
                + (", AMX-INT8 tiles" if self.tiles else "")
                + (", two panels a call" if self.pairs else ""))


def triton_runs(act: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton form runs here: 16-bit activations on a CUDA device with int8
    tensor cores that Triton drives (compute capability 8.0 or later)."""
    from servelm.kernels import triton_quant

    return (device.type == "cuda" and act in (torch.bfloat16, torch.float16)
            and triton_quant.available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def triton_applies(src: nn.Module, act: torch.dtype, device: torch.device) -> bool:
    """The Triton form's conditions for a layer: calibrated, a block dividing its inputs,
    and triton_runs."""
    return (calibrated(src) is not None and layer_block(src) > 0
            and triton_runs(act, device))


class W8A8TritonLinear(nn.Module):
    """The same layer on CUDA's int8 tensor cores (servelm.kernels.triton_quant.w8a8_linear):
    the weights smoothed and quantised as W8A8Linear's, kept row-major int8 [N, K] with their
    scales [N, K / block]; the activations quantised per call by a kernel of their own. Any
    device Triton runs on (its interpreter on CPU tensors, in the tests)."""

    packed_tensors = ("weight", "weight_scale", "inv_scale", "bias")
    check_tolerance = W8A8Linear.check_tolerance  # the same arithmetic, the same bound

    def __init__(self, src: nn.Module, alpha: float | None = None):
        super().__init__()
        from servelm.kernels import triton_quant

        if not triton_quant.available():
            raise RuntimeError("w8a8 on CUDA needs Triton")
        self.in_features, self.out_features = src.in_features, src.out_features
        self.block, q, scale, inv, bias = smoothed(src, alpha)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("inv_scale", inv)
        self.register_buffer("bias", bias)
        self._linear = triton_quant.w8a8_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.inv_scale, self.weight, self.weight_scale, self.block,
                            self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 x int8 activations per block of {self.block}, smoothed, Triton")
