"""Linear methods: the ways one linear layer's matmul can run, and the layer that runs the
method chosen for each row bucket.

A layer's *source* is what loading (and quantisation) left: an `nn.Linear` in the model
dtype, or an `Int4Linear` / `Int8Linear` in the C++ kernels' tiles. Each method builds, from
the source, a module computing the same function (up to its rounding) in its own layout:

| method   | sources        | what runs                                                     |
|----------|----------------|---------------------------------------------------------------|
| tiles    | bf16/fp32/int4/int8 | servelm's C++ kernels over 16-row tiles (quant.cpp)     |
| onednn   | all (CPU)      | oneDNN's prepacked matmul (AMX where the CPU has it); int4/int8 weights dequantised once to the activation dtype |
| amx      | bf16, int4, int8 (AMX CPUs) | servelm's AMX tile kernel over the weight packed in tile order (amx_linear.cpp), 32 rows x 32 outputs a step; int4/int8 weights dequantised once to bf16; batch-invariant; a SwiGLU gate_up writes silu(gate) * up itself (GatedMLP.fuse_activation) |
| int4pack | int4           | PyTorch's `_weight_int4pack_mm_for_cpu` (bf16; fp32 activations are rounded to bf16 for it) |
| int8pack | int8           | PyTorch's `_weight_int8pack_mm` (row-major int8)              |
| qdot     | int4 (groups of 32) / int8 | servelm's AVX2 integer dot products over activations quantised per call to int16 per block of 32, ~16 bits (qdot.cpp) |
| gemv     | fp32, bf16     | servelm's AVX2 + FMA fp32 kernel for a few rows over the layer's own weight (gemv.cpp), 4 weight rows at a time |
| gemv_rows | fp32, bf16    | the same kernel reading a weight row after another (one sequential stream) |
| panels   | fp32, bf16, int4, int8 | servelm's AVX2 + FMA GEMM over the weight packed into 16-column panels (panels.cpp), 6 rows x 16 outputs in registers; int4 / int8 panels decoded to fp32 a K block at a time, once per call |
| q8act    | int4 (groups a multiple of 32), bf16 activations only | servelm's AVX2 byte multiply-add over activations quantised per call to int8 per block of 32 (q8act.cpp): llama.cpp's Q4_0 x Q8_0, OpenVINO's dynamic quantisation; ~8-bit activations |
| bfp      | bf16 (bf16 activations only), int8 | servelm's AVX2 int16 multiply-add (bfp.cpp): weights and activations as block floating point, 12- and 13-bit mantissas sharing a power-of-two exponent per block of 64 inputs, the block sums exact in int32, within bf16's output rounding of the bf16 product; int8 weights are their own mantissas (a byte each, widened as read) against 15-bit activation blocks |
| w8a8     | calibrated layers (any format), bf16 activations, AVX-512 VNNI or AVX-VNNI; from 23 rows | servelm's VNNI kernel (w8a8.cpp): int8 weights scaled per channel and block times activations smoothed (SmoothQuant) and quantised per call to int8 per block of up to 128 inputs; an int8 copy of the weights |
| w8a8_pairs | w8a8's, AVX-512 VNNI | the same weights and arithmetic, two panels (7 rows x 32 outputs) a micro-kernel call (the same bits) |
| w8a8_amx | w8a8's, on CPUs with AMX-INT8 | the same weights and arithmetic on AMX-INT8 tiles (w8a8_tiles.h: 32 rows x 32 outputs a step, the same bits) |
| torch    | all            | plain `F.linear` (quantised: dequantise + matmul): the reference |

Each method is a `LinearMethod` (its name, whether it applies, how it builds, its flags for
the tuner), registered once in `LINEAR_METHODS` in the untuned default's order of
preference; `METHODS`, `BF16_INSIDE`, `DEQUANTISED`, `applies`, `build`, `tunable` and
`default_method` read that registry. A source's format is a `WeightFormat` (`of(src)`): its
name (the tuner's cache keys), its fp32 reference weight, a head of its first outputs, and
the methods that can run it (`methods`).

`BucketedLinear` holds one module per row bucket (`BUCKET_ROWS`: one row, a few, a batch,
prompt-sized) and runs the one for the call's row count; where every bucket chose the same
method the layer is that module alone. servelm.tuning decides which, once, at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import amx, bfp, gemv, panels, q8act, qdot, w8a8
from servelm.prepack import PackedLinear, prepack_supported
from servelm.quantization.formats import (TILE_OPS, Int4Linear, Int8Linear, QuantLinear,
                                          TiledLinear, fp32_weight, kernels_available)
from servelm.quantization.numerics import tinygemm_operands, unpack_int4

# Representative row counts of the buckets; a call of r rows runs bucket i's method for the
# bucket whose row count is nearest r in ratio (bounds at the geometric means: 1 | 2-22 |
# 23-181 | 182+).
BUCKET_ROWS = (1, 8, 64, 512)
_BOUNDS = (1, 22, 181)


def bucket_row_range(bucket: int) -> tuple[int, int]:
    """The row counts (first, last) whose calls run bucket `bucket`'s method."""
    lo = 1 if bucket == 0 else _BOUNDS[bucket - 1] + 1
    return lo, _BOUNDS[bucket] if bucket < len(_BOUNDS) else 1 << 30


def bucket_of(rows: int) -> int:
    """The bucket (index into BUCKET_ROWS) a call of `rows` rows runs in."""
    for i, bound in enumerate(_BOUNDS):
        if rows <= bound:
            return i
    return len(_BOUNDS)


# ---------------------------------------------------------------- weight formats

@dataclass(frozen=True)
class WeightFormat:
    """What a source layer stores: a plain weight of one dtype (kind 'bfloat16', 'float32',
    'float16', ...: an nn.Linear) or servelm's int8 (per output channel) or int4 (per group of
    `group_size` inputs) quantisation. `of(src)` reads it from a source once; the rest asks
    the format, not the layer's class. It lives beside the methods, not in
    servelm.quantization.formats, because `methods` reads their registry, which sits above
    quantization in the import layering.

    Each method taking `src` expects a source of this format (the one `of` returned it for)."""

    kind: str
    group_size: int = 0  # int4: the inputs sharing a scale and a min

    @staticmethod
    def of(src: nn.Module) -> "WeightFormat":
        """The format of a source layer: an nn.Linear, an Int4Linear or an Int8Linear."""
        if isinstance(src, Int4Linear):
            return WeightFormat("int4", src.group_size)
        if isinstance(src, Int8Linear):
            return WeightFormat("int8")
        if isinstance(src, nn.Linear):
            return WeightFormat(str(src.weight.dtype).removeprefix("torch."))
        raise TypeError(f"not a linear layer source: {type(src).__name__}")

    @property
    def quantised(self) -> bool:
        """int4 or int8: the weight is codes and scales, not the model dtype's values."""
        return self.kind in ("int4", "int8")

    @property
    def name(self) -> str:
        """'bfloat16', 'float32', 'int8' or 'int4g<group>': the tuner's cache keys start with
        it (servelm.tuning), so it never changes for a format."""
        return f"int4g{self.group_size}" if self.kind == "int4" else self.kind

    def stored(self, src: nn.Module) -> torch.Tensor:
        """The tensor holding the source's weight: its own (plain) or its codes (quantised)."""
        return src.qweight if self.quantised else src.weight

    def device(self, src: nn.Module) -> torch.device:
        return self.stored(src).device

    def reference(self, src: nn.Module) -> torch.Tensor:
        """The source's weights [N, K] in fp32: what every method must compute with."""
        return fp32_weight(src)

    @torch.no_grad()
    def head(self, src: nn.Module, n: int) -> nn.Module:
        """A source of this format holding `src`'s first n output features (n a multiple of
        16, the tiles' height)."""
        if n % 16 or not 0 < n <= src.out_features:
            raise ValueError(f"head: n must be a multiple of 16 in 1..{src.out_features}, got {n}")
        out = self._head(src, n)
        if w8a8.calibrated(src) is not None:  # the same inputs: the same calibration
            w8a8.set_calibration(out, w8a8.calibrated(src), w8a8.longest_block(src))
        return out

    def _head(self, src: nn.Module, n: int) -> nn.Module:
        bias = None if src.bias is None else src.bias[:n].clone()
        if self.kind == "int4":
            t = n // 16
            return Int4Linear(src.qweight[:t].clone(), src.scales[:t].clone(),
                              src.mins[:t].clone(), src.group_size, n, bias,
                              use_kernel=src.use_kernel)
        if self.kind == "int8":
            return Int8Linear(src.int8_weight()[:n].clone(), src.scales[:n].clone(), bias,
                              tiled=src.tiled, use_kernel=src.use_kernel)
        out = nn.Linear(src.in_features, n, bias=bias is not None, device="meta")
        out.weight = nn.Parameter(src.weight.detach()[:n].clone(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out

    def methods(self, src: nn.Module, act: torch.dtype, kernels: bool) -> list[str]:
        """The registered methods that can run `src` (of this format; whether one runs also
        depends on its shape and device) with activations of dtype `act`, in preference
        order (METHODS)."""
        return [m.name for m in LINEAR_METHODS if m.applies(src, act, kernels)]


# ---------------------------------------------------------------- methods

@dataclass(frozen=True)
class LinearMethod:
    """One way to run a linear layer's matmul.

    runs(src, act): whether it takes this source and activation dtype, asked only on the CPU
    with the optimised kernels allowed (the reference, `anywhere`, takes every source
    everywhere); make(src, act): the module computing src's matmul its way.
    bf16_inside: it computes in bf16 whatever the activations (fp32 ones rounded on the way
    in); the tuner leaves it out of fp32 runs, which asked for fp32 accuracy (on a Xeon with
    AMX, int4pack at one row flipped a greedy token of the embedded model against the fp32
    reference); a forced --linear-method still runs it.
    dequantised: it runs a quantised (int4, int8) layer on a dequantised copy of its weights
    in the activations' dtype, 4x an int4 layer's bytes in bf16: the tuner gives a quantised
    layer at most one such method (tuning._one_dequantised_copy).
    untuned_quantised: the untuned default (default_method) may pick it for a quantised
    layer (not onednn: its dequantised copy would undo the quantisation's memory saving).
    first_bucket: the first row bucket the tuner may choose it for (w8a8: from a batch's
    rows on; one or a few rows are memory-bound, where its int8 copy of the weights is
    twice an int4 layer's bytes)."""

    name: str
    runs: Callable[[nn.Module, torch.dtype], bool]
    make: Callable[[nn.Module, torch.dtype], nn.Module]
    bf16_inside: bool = False
    dequantised: bool = False
    untuned_quantised: bool = True
    anywhere: bool = False
    first_bucket: int = 0

    def applies(self, src: nn.Module, act: torch.dtype, kernels: bool) -> bool:
        """Whether it can run this source with activations of dtype `act` (kernels: the
        optimised CPU paths may run; False leaves only the reference)."""
        if self.anywhere:
            return True
        if not kernels or WeightFormat.of(src).device(src).type != "cpu":
            return False
        return self.runs(src, act)

    @torch.no_grad()
    def build(self, src: nn.Module, act: torch.dtype) -> nn.Module:
        """A module running `src`'s matmul this way (which must apply)."""
        return self.make(src, act)

    def tunable(self, act: torch.dtype) -> bool:
        """Whether the tuner may choose it for activations of dtype `act`."""
        return not (act == torch.float32 and self.bf16_inside)


def _tiles_runs(src: nn.Module, act: torch.dtype) -> bool:
    fmt = WeightFormat.of(src)
    if not fmt.quantised:
        w = src.weight
        return (w.dtype in TILE_OPS and w.dtype == act and kernels_available()
                and hasattr(torch.ops.servelm_quant, "f32_linear")
                and (w.dtype == torch.float32 or src.in_features % 2 == 0))
    if fmt.kind == "int8":
        return src.use_kernel and src.tiled
    return src.use_kernel


def _torch_make(src: nn.Module, act: torch.dtype) -> nn.Module:
    return _Dequantised(src) if WeightFormat.of(src).quantised else src


def _tiles_make(src: nn.Module, act: torch.dtype) -> nn.Module:
    return src if WeightFormat.of(src).quantised else TiledLinear.from_linear(src)


def _onednn_make(src: nn.Module, act: torch.dtype) -> nn.Module:
    if not WeightFormat.of(src).quantised:
        return PackedLinear(src)
    bias = src.bias
    lin = nn.Linear(src.in_features, src.out_features, bias=bias is not None,
                    device="meta")  # weights assigned next: no random init
    lin.weight = nn.Parameter(src.dequantize(act), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().to(act), requires_grad=False)
    return PackedLinear(lin)


def _panels_make(src: nn.Module, act: torch.dtype) -> nn.Module:
    kind = WeightFormat.of(src).kind
    if kind == "int4":
        return panels.Int4PanelLinear(src)
    if kind == "int8":
        return panels.Int8PanelLinear(src)
    return panels.PanelLinear(src)


def _int4pack_runs(src: nn.Module, act: torch.dtype) -> bool:
    return (WeightFormat.of(src).kind == "int4" and act in (torch.bfloat16, torch.float32)
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and src.in_features % 32 == 0 and src.out_features % 8 == 0)


def _int8pack_make(src: nn.Module, act: torch.dtype) -> nn.Module:
    if not src.tiled:
        return src  # already row-major int8 on _weight_int8pack_mm
    return Int8Linear(src.int8_weight().contiguous(), src.scales[: src.out_features].clone(),
                      src.bias, tiled=False)


# Every method, in the order the untuned default prefers them (default_method).
LINEAR_METHODS: tuple[LinearMethod, ...] = (
    LinearMethod("tiles", _tiles_runs, _tiles_make),
    LinearMethod("onednn", lambda src, act: prepack_supported(act, "cpu"), _onednn_make,
                 dequantised=True, untuned_quantised=False),
    LinearMethod("qdot", qdot.applies, lambda src, act: qdot.QDotLinear(src)),
    LinearMethod("int4pack", _int4pack_runs, lambda src, act: Int4PackLinear(src),
                 bf16_inside=True),
    LinearMethod("int8pack",
                 lambda src, act: (WeightFormat.of(src).kind == "int8"
                                   and act in (torch.bfloat16, torch.float32)),
                 _int8pack_make),
    LinearMethod("gemv", gemv.applies, lambda src, act: gemv.GemvLinear(src)),
    LinearMethod("gemv_rows", gemv.applies, lambda src, act: gemv.GemvLinear(src, by_row=True)),
    LinearMethod("panels", panels.applies, _panels_make),
    LinearMethod("q8act", q8act.applies, lambda src, act: q8act.Int4Q8Linear(src)),
    LinearMethod("bfp", bfp.applies, lambda src, act: bfp.BfpLinear(src)),
    LinearMethod("amx", amx.applies, lambda src, act: amx.AmxLinear(src), dequantised=True),
    LinearMethod("w8a8", w8a8.applies, lambda src, act: w8a8.W8A8Linear(src), dequantised=True,
                 untuned_quantised=False, first_bucket=2),
    LinearMethod("w8a8_pairs", w8a8.pairs_apply,
                 lambda src, act: w8a8.W8A8Linear(src, pairs=True), dequantised=True,
                 untuned_quantised=False, first_bucket=2),
    LinearMethod("w8a8_amx", w8a8.tiles_apply, lambda src, act: w8a8.W8A8Linear(src, tiles=True),
                 dequantised=True, untuned_quantised=False, first_bucket=2),
    LinearMethod("torch", lambda src, act: True, _torch_make, anywhere=True),
)
METHODS_BY_NAME: dict[str, LinearMethod] = {m.name: m for m in LINEAR_METHODS}

# The registry's names and flags as the tuple constants callers read.
METHODS = tuple(METHODS_BY_NAME)
BF16_INSIDE = tuple(m.name for m in LINEAR_METHODS if m.bf16_inside)
DEQUANTISED = tuple(m.name for m in LINEAR_METHODS if m.dequantised)
# The w8a8 forms: each holds an int8 copy of a layer's weights (of any format), a layer one.
W8A8_FORMS = ("w8a8", "w8a8_pairs", "w8a8_amx")


def by_name(name: str) -> LinearMethod:
    """The registered method called `name` (ValueError for any other name)."""
    try:
        return METHODS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown linear method {name!r}; one of {', '.join(METHODS)}") from None


def weight_format(src: nn.Module) -> str:
    """'bfloat16', 'float32', 'int8' or 'int4g<group>': what a source layer stores."""
    return WeightFormat.of(src).name


def reference_weight(src: nn.Module) -> torch.Tensor:
    """The source's weights [N, K] in fp32: what every method must compute with."""
    return WeightFormat.of(src).reference(src)


def applies(method: str, src: nn.Module, act: torch.dtype, kernels: bool) -> bool:
    """Whether `method` can run this source with activations of dtype `act`
    (kernels: the optimised CPU paths may run; False leaves only "torch", the reference)."""
    return by_name(method).applies(src, act, kernels)


def eligible(times_us: dict[str, list[float]]) -> dict[str, list[float]]:
    """Measured µs per call by method and bucket, inf where the tuner may not choose the
    method (the buckets before its first_bucket)."""
    return {m: [math.inf if b < by_name(m).first_bucket else x for b, x in enumerate(t)]
            for m, t in times_us.items()}


def tunable(method: str, act: torch.dtype) -> bool:
    """Whether the tuner may choose `method` for activations of dtype `act`."""
    return by_name(method).tunable(act)


def default_method(src: nn.Module, act: torch.dtype, kernels: bool,
                   auto: bool = False) -> str:
    """The method used without tuning: servelm's tiles where they run, else oneDNN's
    prepacked matmul (plain weights), servelm's AVX2 integer kernels (int4/int8) or
    PyTorch's own int4/int8 kernels. auto (no method forced, tuned or with tuning off):
    only among the methods the tuner may choose (tunable)."""
    quantised = WeightFormat.of(src).quantised
    for m in LINEAR_METHODS:
        if quantised and not m.untuned_quantised:
            continue
        if auto and not m.tunable(act):
            continue
        if m.applies(src, act, kernels):
            return m.name
    return "torch"


def head(src: nn.Module, n: int) -> nn.Module:
    """A source of the same format holding `src`'s first n output features (n a multiple
    of 16, the tiles' height): what the tuner times in place of a layer too large to time
    whole (an LM head), since a method's time grows with the outputs as it does with K."""
    return WeightFormat.of(src).head(src, n)


def build(method: str, src: nn.Module, act: torch.dtype) -> nn.Module:
    """A module running `src`'s matmul by `method` (which must apply)."""
    return by_name(method).build(src, act)


class _Dequantised(nn.Module):
    """A quantised source run by PyTorch alone: dequantise, then F.linear (the reference)."""

    def __init__(self, src: QuantLinear):
        super().__init__()
        self.src = src
        self.in_features, self.out_features = src.in_features, src.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.src.bias
        return F.linear(x, self.src.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))


class Int4PackLinear(nn.Module):
    """An int4 layer on PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16
    activations): the same groups as Int4Linear, as w = s (q - 8) + z with z = m + 8 s,
    scales and zeros rounded to bf16 (the kernel's operand). fp32 activations are rounded to
    bf16 on the way in and the result widened back (compute_dtype says so: its known-answer
    check allows bf16 rounding)."""

    compute_dtype = torch.bfloat16

    def __init__(self, src: Int4Linear):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        self.group_size = src.group_size
        q = unpack_int4(src.qweight, src.out_features)
        nibbles, sz = tinygemm_operands(q, src.scales, src.mins, src.group_size, src.out_features)
        del nibbles
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 8))
        self.register_buffer("scales_zeros", sz)
        b = src.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.bfloat16).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"Int4PackLinear takes bfloat16 or float32 activations, got {x.dtype}")
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.weight,
                                                       self.group_size, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class BucketedLinear(nn.Module):
    """One linear layer whose matmul runs, for each row bucket, the module chosen for it."""

    def __init__(self, modules: list[nn.Module], methods: list[str]):
        super().__init__()
        if len(modules) != len(BUCKET_ROWS) or len(methods) != len(BUCKET_ROWS):
            raise ValueError(f"one module and method per bucket ({len(BUCKET_ROWS)})")
        distinct = list({id(m): m for m in modules}.values())
        self.impls = nn.ModuleList(distinct)  # each once, so .to() and packing see them
        self._by_bucket = list(modules)
        self.methods = tuple(methods)
        first = modules[0]
        self.in_features, self.out_features = first.in_features, first.out_features
        self.bias = getattr(first, "bias", None)

    def module_for(self, rows: int) -> nn.Module:
        return self._by_bucket[bucket_of(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        b = self._by_bucket
        if rows <= 22:
            return b[0](x) if rows <= 1 else b[1](x)
        return b[2](x) if rows <= 181 else b[3](x)

    def extra_repr(self) -> str:
        return "methods by rows: " + ", ".join(
            f"{r}: {m}" for r, m in zip(BUCKET_ROWS, self.methods))

