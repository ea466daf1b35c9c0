"""servelm's weight formats as linear layers: Int8Linear, Int4Linear (weight-only int8 / int4,
activations in the model's dtype) and TiledLinear (a bf16 / fp32 weight in the same tiles,
not a quantisation), over the numerics in servelm.quantization.numerics.

On CUDA, int4 layers of bf16 models also hold the weight in the layout of PyTorch's
tinygemm kernel (`aten._weight_int4pack_mm`: the same groups, w = s * (q - 8) + z with
z = m + 8 s, scales and zeros in bf16) and run it for up to `CUDA_INT4_MAX_ROWS` rows;
past those rows the weight is dequantised by a Triton kernel (servelm.kernels.triton_quant)
for one bf16 matmul. int8 layers run a Triton matmul that converts the int8 weight in
registers for up to `CUDA_INT8_MAX_ROWS` rows (triton_quant.int8_linear), past them convert
the weight in the matmul's input and scale after: PyTorch's CUDA `_weight_int8pack_mm` lost
to that at every row count on an H200 (2.6x at one row, 40x at 64, over Llama-3-8B's four
layers; benchmarks/cuda_int4.py).
Each kernel is first run once on a small known case; one that is missing or disagrees is
not used.

On CPU with the C++ kernels (servelm/kernels/csrc/quant.cpp) every call, decode or
prefill, runs a kernel that streams the packed weight once per few activation rows and
decodes it in registers to bf16 for vdpbf16ps (weights are stored in 16-row tiles for it;
see the layouts there). Without the kernels (no compiler, KernelConfig.cpu_kernels off, CUDA) the
same formats run in PyTorch: dequantise + matmul, or int8 through `aten._weight_int8pack_mm`
when the weight was quantised without the kernels (row-major int8).

`TiledLinear` is not a quantisation: a bf16 or fp32 model's weights in the same kind of
16-row tiles, so the C++ kernels stream them for decode (bf16 layers also on the
DecodeStack); servelm.tuning swaps them in where they measure fastest (the "tiles" method).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels import load_ops
from servelm.quantization.numerics import (DEFAULT_GROUP_SIZE, dequantize_int4,
                                           dequantize_int4_reference, dequantize_int8,
                                           dequantize_tinygemm, inner_k_tiles, pack_int8,
                                           pack_tiles, quantize_int4, quantize_int4_reference,
                                           quantize_int8, tinygemm_operands, unpack_int4,
                                           unpack_int8, unpack_tiles)

logger = logging.getLogger(__name__)

# Rows up to which an int4 layer runs tinygemm on CUDA (a matrix-vector kernel at heart: it
# reads the weight once per 16 rows); past them it dequantises the whole weight
# (servelm.kernels.triton_quant) for a bf16 matmul (benchmarks/cuda_int4.py).
CUDA_INT4_MAX_ROWS = 32
# int8 layers on CUDA, bf16 / fp16 activations: up to this many rows servelm.kernels.
# triton_quant.int8_linear (the weight converted in registers); past them the weight is
# converted for one dense matmul.
CUDA_INT8_MAX_ROWS = 64
# PyTorch's CPU _weight_int8pack_mm gives garbage (or crashes) unless in_features is a
# multiple of this; other int8 layers on the CPU dequantise.
INT8PACK_K = 16


_cuda_ops: dict[str, bool] = {}


def _cuda_op_works(name: str, probe) -> bool:
    """Whether this PyTorch build runs a CUDA op right: probe() runs it on a small known
    case and raises if it fails or disagrees (asked once per process; a kernel that is
    missing or computes with another layout leaves the layer on the PyTorch fallback)."""
    if name not in _cuda_ops:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # a probe cannot run inside a CUDA graph (layers ask when built)
        try:
            probe()
            _cuda_ops[name] = True
        except (RuntimeError, NotImplementedError) as e:
            logger.warning("%s is not used on CUDA: %s", name, e)
            _cuda_ops[name] = False
    return _cuda_ops[name]


# ---------------------------------------------------------------- layers

_has_ops: bool | None = None


def kernels_available() -> bool:
    """Whether the C++ kernels are loaded (built on first use).
    They need AVX-512 with BF16; elsewhere the library builds empty and registers no op."""
    global _has_ops
    if not load_ops("quant"):
        return False
    if _has_ops is None:
        _has_ops = hasattr(torch.ops.servelm_quant, "int4_linear")
    return _has_ops


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class QuantLinear(nn.Module):
    """Common parts of the weight-format layers: shape, bias, and the path a call runs.

    The path (`path`: its name; `_path`: the function forward calls) is chosen once from
    the layer's state: its weight's device, `use_kernel` and the layout it holds; again
    only when that state changes (use_kernel set, the module moved). It is a plain function
    of (layer, x), not a bound method: no reference cycle. A path keeps to its own input
    checks (an activation dtype it does not take runs the dequantised matmul)."""

    method = ""
    packed_tensors = ("qweight", "scales", "mins", "bias")  # what pack_weights moves

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 use_kernel: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # None: wherever the kernels load (asked once, not per call).
        self._use_kernel = kernels_available() if use_kernel is None else bool(
            use_kernel and kernels_available())

    @property
    def use_kernel(self) -> bool:
        return self._use_kernel

    @use_kernel.setter
    def use_kernel(self, value: bool) -> None:
        self._use_kernel = bool(value)
        if "_path" in self.__dict__:
            self._select()

    def _select(self) -> None:
        """Bind the path this layer's state calls for (subclasses: _choose)."""
        self.path, self._path = self._choose()

    def _choose(self) -> tuple[str, object]:
        raise NotImplementedError

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if "_path" in self.__dict__:
            self._select()  # a move to another device calls for another path
        return out

    def _device(self) -> torch.device:
        return self.qweight.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # no rows (a prompt chunk that samples nothing): CUDA's int4 and
            return x.new_zeros(*x.shape[:-1], self.out_features)  # int8 matmuls refuse those
        return self._path(self, x)

    # The paths every format shares.
    @staticmethod
    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """servelm's C++ kernel (CPU): fp32 and bf16 activations as they are, others in fp32."""
        if x.dtype in _KERNEL_DTYPES:
            return self._kernel(x)
        return self._kernel(x.float()).to(x.dtype)

    @staticmethod
    def _run_dequantised(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: the dequantised weight in x's dtype, one F.linear."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Int8Linear(QuantLinear):
    """Symmetric per-output-channel int8 weights.

    Stored tiled for the C++ kernel when it is available and in_features % 4 == 0, else
    row-major [N, K] int8 for PyTorch's `_weight_int8pack_mm`. Paths: "kernel" (tiled, on
    the CPU with the kernels), "int8pack" (row-major on the CPU), "cuda" (row-major on
    CUDA), "dequantise" (anything else).
    """

    method = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 tiled: bool | None = None, use_kernel: bool | None = None):
        super().__init__(q.shape[1], q.shape[0], bias, use_kernel)
        if tiled is None:
            tiled = q.device.type == "cpu" and q.shape[1] % 4 == 0 and self.use_kernel
        self.tiled = tiled
        if tiled:
            q, scales = pack_int8(q, scales)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self._select()  # on CUDA this asks the Triton probe now, never inside a graph capture

    @classmethod
    def from_linear(cls, linear: nn.Linear, use_kernel: bool | None = None) -> "Int8Linear":
        q, s = quantize_int8(linear.weight)
        return cls(q, s, linear.bias, use_kernel=use_kernel)

    def int8_weight(self) -> torch.Tensor:
        """q int8 [N, K], row-major."""
        return unpack_int8(self.qweight, self.out_features) if self.tiled else self.qweight

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int8(self.int8_weight(), self.scales[: self.out_features], dtype)

    def _choose(self):
        device = self._device()
        if self.tiled:
            if self.use_kernel and device.type == "cpu":
                return "kernel", QuantLinear._run_kernel
            return "dequantise", QuantLinear._run_dequantised
        if device.type == "cuda":
            self._triton = _cuda_triton_int8_works(device)
            return "cuda", Int8Linear._run_cuda
        if device.type == "cpu" and self.in_features % INT8PACK_K == 0:
            return "int8pack", Int8Linear._run_int8pack
        return "dequantise", QuantLinear._run_dequantised

    def _kernel(self, x):
        return torch.ops.servelm_quant.int8_linear.default(x, self.qweight, self.scales,
                                                           self.out_features, self.bias)

    @staticmethod
    def _run_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """Row-major int8 on CUDA: the Triton matmul (bf16 / fp16, up to CUDA_INT8_MAX_ROWS
        rows, where its probe passed), else the weight converted in the matmul's input."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if (self._triton and x.dtype in (torch.bfloat16, torch.float16)
                and x.numel() <= CUDA_INT8_MAX_ROWS * self.in_features):
            from servelm.kernels import triton_quant
            return triton_quant.int8_linear(x, self.qweight, self.scales, bias)
        x2 = x.reshape(-1, self.in_features)
        if x.dtype == torch.float16:  # x . q could pass fp16's 65504 before scaling
            y = F.linear(x2, self.dequantize(x.dtype))
        else:
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    @staticmethod
    def _run_int8pack(self, x: torch.Tensor) -> torch.Tensor:
        """Row-major int8 on the CPU: PyTorch's fused kernel (scales in x's dtype)."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias


class Int4Linear(QuantLinear):
    """Group-wise asymmetric int4 weights (w = s * q + m per group of inputs), tiled.
    Paths: "kernel" (on the CPU with the kernels), "cuda" (tinygemm for up to
    CUDA_INT4_MAX_ROWS bf16 rows where it takes the shape, else the weight dequantised by
    the Triton kernel where its probe passed, else by PyTorch), "dequantise" (anything else).
    """

    method = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, out_features: int, bias: torch.Tensor | None = None,
                 use_kernel: bool | None = None):
        super().__init__(qweight.shape[1] // 8, out_features, bias, use_kernel)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        # CUDA: the same weights in tinygemm's layout, when its kernel takes this shape.
        self.register_buffer("tg_weight", None)
        self.register_buffer("tg_scales_zeros", None)
        tiles = inner_k_tiles(self.in_features)
        if qweight.is_cuda and tiles and out_features % 8 == 0 and _cuda_int4pack_works(qweight.device):
            nibbles, sz = tinygemm_operands(unpack_int4(qweight), scales, mins, group_size,
                                            out_features)
            self.tg_weight = torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)
            self.tg_scales_zeros = sz
        self._select()  # on CUDA this asks the Triton probe now, never inside a graph capture

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE,
                    symmetric: bool = False, use_kernel: bool | None = None) -> "Int4Linear":
        q, s, m = quantize_int4(linear.weight, group_size, symmetric)
        return cls(q, s, m, group_size, linear.out_features, linear.bias, use_kernel)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.mins, self.group_size,
                               self.out_features, dtype)

    def _choose(self):
        device = self._device()
        if self.use_kernel and device.type == "cpu":
            return "kernel", QuantLinear._run_kernel
        if device.type == "cuda":
            self._triton = _cuda_triton_dequant_works(device)
            return "cuda", Int4Linear._run_cuda
        return "dequantise", QuantLinear._run_dequantised

    def _kernel(self, x):
        return torch.ops.servelm_quant.int4_linear.default(
            x, self.qweight, self.scales, self.mins, self.group_size, self.out_features, self.bias)

    @staticmethod
    def _run_cuda(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if (self.tg_weight is not None and x.dtype == torch.bfloat16
                and x.numel() <= CUDA_INT4_MAX_ROWS * self.in_features):
            y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.in_features).contiguous(),
                                                   self.tg_weight, self.group_size,
                                                   self.tg_scales_zeros)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        if self._triton:
            from servelm.kernels import triton_quant
            w = triton_quant.dequantize_int4(self.qweight, self.scales, self.mins,
                                             self.group_size, self.out_features, x.dtype)
            return F.linear(x, w, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


# The bf16/fp32 tiled ops by weight dtype.
TILE_OPS = {torch.bfloat16: "bf16_linear", torch.float32: "f32_linear"}


class TiledLinear(QuantLinear):
    """A bf16 or fp32 model's linear layer on the C++ kernels: not a quantisation, the same
    weights in the kernels' 16-row tiles (bf16: the int4/int8 kernels' vdpbf16ps operand;
    fp32: K vectors of 16). Below 8 rows the weight streams through the dot products (bf16)
    or broadcast FMAs (fp32) once per 4 rows; from 8 rows a GEMM micro-kernel runs over the
    tiles in place. oneDNN's prepacked matmuls streamed the LM head at ~50 GB/s at one row
    here, these ~62 (bf16). bf16 layers can join the DecodeStack. Paths: "kernel" (on the
    CPU with the kernels: activations of the weight's dtype run the tiles, others the
    dequantised matmul), "dequantise" (anything else)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_kernel: bool | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias, use_kernel)
        if weight.dtype not in TILE_OPS:
            raise TypeError(f"TiledLinear takes bfloat16 or float32 weights, got {weight.dtype}")
        self.dtype = weight.dtype
        self.method = "bf16" if weight.dtype == torch.bfloat16 else "fp32"
        self.register_buffer("qweight", pack_tiles(weight.detach()))
        self._select()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "TiledLinear":
        return cls(linear.weight, linear.bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return unpack_tiles(self.qweight, self.out_features).to(dtype)

    def _choose(self):
        if self.use_kernel and self._device().type == "cpu":
            self._op = getattr(torch.ops.servelm_quant, TILE_OPS[self.dtype]).default
            return "kernel", TiledLinear._run_tiles
        self._op = None
        return "dequantise", QuantLinear._run_dequantised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._path(self, x)  # no rows: each path answers for itself

    @staticmethod
    def _run_tiles(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.dtype:
            return self._op(x, self.qweight, self.out_features, self.bias)
        return QuantLinear._run_dequantised(self, x)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.method} tiles"


def fp32_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weights [N, K] in fp32: a weight-format layer's dequantised, a plain
    layer's own (what every linear method of it must compute with)."""
    if isinstance(layer, QuantLinear):
        return layer.dequantize(torch.float32)
    return layer.weight.detach().float()


def _cuda_int4pack_works(device: torch.device) -> bool:
    """tinygemm runs here and computes with the weights `tinygemm_operands` describe."""
    def probe():
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (16, 128), generator=g, dtype=torch.uint8)
        s = torch.rand(1, 4, 16, generator=g).add_(0.5).half()
        m = torch.randn(1, 4, 16, generator=g).half()
        nibbles, sz = tinygemm_operands(q, s, m, 32, 16)
        x = torch.randn(2, 128, generator=g).bfloat16()
        want = x.float() @ dequantize_tinygemm(nibbles, sz, 32).T
        w = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), 2)
        got = torch.ops.aten._weight_int4pack_mm(x.to(device), w, 32, sz.to(device))
        if not torch.allclose(got.float().cpu(), want, rtol=0.02, atol=0.02 * want.abs().max().item()):
            raise RuntimeError("tinygemm disagrees with its operands' weights")
    return _cuda_op_works("int4pack", probe)


def _cuda_triton_dequant_works(device: torch.device) -> bool:
    """servelm.kernels.triton_quant's int4 dequantisation compiles here and gives the
    PyTorch reference's weights."""
    def probe():
        from servelm.kernels import triton_quant
        g = torch.Generator().manual_seed(0)
        packed, s, m = quantize_int4_reference(torch.randn(40, 256, generator=g), 64)
        want = dequantize_int4_reference(packed, s, m, 64, 40)
        try:
            got = triton_quant.dequantize_int4(packed.to(device), s.to(device), m.to(device),
                                               64, 40, torch.float32)
        except Exception as e:  # Triton's compile errors are no RuntimeError
            raise RuntimeError(f"{type(e).__name__}: {e}") from e
        if not torch.allclose(got.cpu(), want, rtol=1e-6, atol=1e-6):
            raise RuntimeError("the Triton int4 dequantisation disagrees with the reference")
    return _cuda_op_works("int4-triton-dequant", probe)


def _cuda_triton_int8_works(device: torch.device) -> bool:
    """servelm.kernels.triton_quant's int8 matmul compiles here and agrees with the
    dequantised weight's matmul (bf16 activations, a bias, rows and columns past a block)."""
    def probe():
        from servelm.kernels import triton_quant
        g = torch.Generator().manual_seed(0)
        q, s = quantize_int8(torch.randn(40, 256, generator=g))
        x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
        b = torch.randn(40, generator=g).to(torch.bfloat16)
        want = x.float() @ dequantize_int8(q, s, torch.float32).T + b.float()
        try:
            got = triton_quant.int8_linear(x.to(device), q.to(device), s.to(device), b.to(device))
        except Exception as e:  # Triton's compile errors are no RuntimeError
            raise RuntimeError(f"{type(e).__name__}: {e}") from e
        if not torch.allclose(got.cpu().float(), want, rtol=2e-2, atol=2e-2):
            raise RuntimeError("the Triton int8 matmul disagrees with the reference")
    return _cuda_op_works("int8-triton", probe)
