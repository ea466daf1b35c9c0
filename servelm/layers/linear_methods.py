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
| torch    | all            | plain `F.linear` (quantised: dequantise + matmul): the reference |

`BucketedLinear` holds one module per row bucket (`BUCKET_ROWS`: one row, a few, a batch,
prompt-sized) and runs the one for the call's row count; where every bucket chose the same
method the layer is that module alone. servelm.tuning decides which, once, at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import amx, bfp, gemv, panels, q8act, qdot
from servelm.prepack import PackedLinear, prepack_supported
from servelm.quantization.formats import (TILE_OPS, Int4Linear, Int8Linear, QuantLinear,
                                          TiledLinear, kernels_available)
from servelm.quantization.numerics import tinygemm_operands, unpack_int4

# Representative row counts of the buckets; a call of r rows runs bucket i's method for the
# bucket whose row count is nearest r in ratio (bounds at the geometric means: 1 | 2-22 |
# 23-181 | 182+).
BUCKET_ROWS = (1, 8, 64, 512)
_BOUNDS = (1, 22, 181)
# In the order the untuned default prefers them (default_method).
METHODS = ("tiles", "onednn", "qdot", "int4pack", "int8pack", "gemv", "gemv_rows", "panels",
           "q8act", "bfp", "amx", "torch")


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


def weight_format(src: nn.Module) -> str:
    """'bfloat16', 'float32', 'int8' or 'int4g<group>': what a source layer stores."""
    if isinstance(src, Int4Linear):
        return f"int4g{src.group_size}"
    if isinstance(src, Int8Linear):
        return "int8"
    if isinstance(src, nn.Linear):
        return str(src.weight.dtype).removeprefix("torch.")
    raise TypeError(f"not a linear layer source: {type(src).__name__}")


def reference_weight(src: nn.Module) -> torch.Tensor:
    """The source's weights [N, K] in fp32: what every method must compute with."""
    if isinstance(src, nn.Linear):
        return src.weight.detach().float()
    return src.dequantize(torch.float32)


def _device(src: nn.Module) -> torch.device:
    return (src.weight if isinstance(src, nn.Linear) else src.qweight).device


def _tiles_ok(src: nn.Module, act: torch.dtype, kernels: bool) -> bool:
    if not kernels or _device(src).type != "cpu":
        return False
    if isinstance(src, nn.Linear):
        w = src.weight
        return (w.dtype in TILE_OPS and w.dtype == act and kernels_available()
                and hasattr(torch.ops.servelm_quant, "f32_linear")
                and (w.dtype == torch.float32 or src.in_features % 2 == 0))
    if isinstance(src, Int8Linear):
        return src.use_kernel and src.tiled
    return src.use_kernel


def applies(method: str, src: nn.Module, act: torch.dtype, kernels: bool) -> bool:
    """Whether `method` can run this source with activations of dtype `act` (kernels: the
    optimised CPU paths may run; False leaves only "torch", the reference)."""
    on_cpu = _device(src).type == "cpu"
    if method == "torch":
        return True
    if not (on_cpu and kernels):
        return False
    if method == "tiles":
        return _tiles_ok(src, act, kernels)
    if method == "onednn":
        return prepack_supported(act, "cpu")
    if method == "qdot":
        return qdot.applies(src, act)
    if method in ("gemv", "gemv_rows"):
        return gemv.applies(src, act)
    if method == "panels":
        return panels.applies(src, act)
    if method == "q8act":
        return q8act.applies(src, act)
    if method == "bfp":
        return bfp.applies(src, act)
    if method == "amx":
        return amx.applies(src, act)
    if method == "int4pack":
        return (isinstance(src, Int4Linear) and act in (torch.bfloat16, torch.float32)
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                and src.in_features % 32 == 0 and src.out_features % 8 == 0)
    if method == "int8pack":
        return isinstance(src, Int8Linear) and act in (torch.bfloat16, torch.float32)
    raise ValueError(f"unknown linear method {method!r}; one of {', '.join(METHODS)}")


# Methods that compute in bf16 whatever the activations: fp32 ones are rounded to bf16 on the
# way in. The tuner leaves them out of fp32 runs, which asked for fp32 accuracy (on a Xeon
# with AMX, int4pack at one row flipped a greedy token of the embedded model against the fp32
# reference); a forced --linear-method still runs them.
BF16_INSIDE = ("int4pack",)
# Methods that run a quantised (int4, int8) layer on a dequantised copy of its weights, in
# the activations' dtype: each copy holds 4x an int4 layer's bytes in bf16, so the tuner
# gives a quantised layer at most one of them (tuning._one_dequantised_copy).
DEQUANTISED = ("onednn", "amx")


def tunable(method: str, act: torch.dtype) -> bool:
    """Whether the tuner may choose `method` for activations of dtype `act`."""
    return not (act == torch.float32 and method in BF16_INSIDE)


def default_method(src: nn.Module, act: torch.dtype, kernels: bool,
                   auto: bool = False) -> str:
    """The method used without tuning: servelm's tiles where they run, else oneDNN's
    prepacked matmul (plain weights), servelm's AVX2 integer kernels (int4/int8) or
    PyTorch's own int4/int8 kernels. auto (no method forced, tuned or with tuning off):
    only among the methods the tuner may choose (tunable)."""
    for m in METHODS:
        if m == "onednn" and not isinstance(src, nn.Linear):
            continue  # a dequantised copy would undo the quantisation's memory saving
        if auto and not tunable(m, act):
            continue
        if applies(m, src, act, kernels):
            return m
    return "torch"


@torch.no_grad()
def head(src: nn.Module, n: int) -> nn.Module:
    """A source of the same format holding `src`'s first n output features (n a multiple
    of 16, the tiles' height): what the tuner times in place of a layer too large to time
    whole (an LM head), since a method's time grows with the outputs as it does with K."""
    if n % 16 or not 0 < n <= src.out_features:
        raise ValueError(f"head: n must be a multiple of 16 in 1..{src.out_features}, got {n}")
    bias = None if src.bias is None else src.bias[:n].clone()
    if isinstance(src, nn.Linear):
        out = nn.Linear(src.in_features, n, bias=bias is not None, device="meta")
        out.weight = nn.Parameter(src.weight.detach()[:n].clone(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out
    if isinstance(src, Int4Linear):
        t = n // 16
        return Int4Linear(src.qweight[:t].clone(), src.scales[:t].clone(), src.mins[:t].clone(),
                          src.group_size, n, bias, use_kernel=src.use_kernel)
    if isinstance(src, Int8Linear):
        return Int8Linear(src.int8_weight()[:n].clone(), src.scales[:n].clone(), bias,
                          tiled=src.tiled, use_kernel=src.use_kernel)
    raise TypeError(f"not a linear layer source: {type(src).__name__}")


@torch.no_grad()
def build(method: str, src: nn.Module, act: torch.dtype) -> nn.Module:
    """A module running `src`'s matmul by `method` (which must apply)."""
    bias = src.bias
    if method == "torch":
        return src if isinstance(src, nn.Linear) else _Dequantised(src)
    if method == "tiles":
        return TiledLinear.from_linear(src) if isinstance(src, nn.Linear) else src
    if method == "onednn":
        if isinstance(src, nn.Linear):
            return PackedLinear(src)
        lin = nn.Linear(src.in_features, src.out_features, bias=bias is not None,
                        device="meta")  # weights assigned next: no random init
        lin.weight = nn.Parameter(src.dequantize(act), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.detach().to(act), requires_grad=False)
        return PackedLinear(lin)
    if method == "qdot":
        return qdot.QDotLinear(src)
    if method in ("gemv", "gemv_rows"):
        return gemv.GemvLinear(src, by_row=method == "gemv_rows")
    if method == "panels":
        if isinstance(src, Int4Linear):
            return panels.Int4PanelLinear(src)
        if isinstance(src, Int8Linear):
            return panels.Int8PanelLinear(src)
        return panels.PanelLinear(src)
    if method == "q8act":
        return q8act.Int4Q8Linear(src)
    if method == "bfp":
        return bfp.BfpLinear(src)
    if method == "amx":
        return amx.AmxLinear(src)
    if method == "int4pack":
        return Int4PackLinear(src)
    if method == "int8pack":
        if not src.tiled:
            return src  # already row-major int8 on _weight_int8pack_mm
        return Int8Linear(src.int8_weight().contiguous(), src.scales[: src.out_features].clone(),
                          bias, tiled=False)
    raise ValueError(f"unknown linear method {method!r}; one of {', '.join(METHODS)}")


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

