"""Weight-only int8 / int4 quantisation as module swaps.

`quantize_model(model, "int8" | "int4")` replaces the model's `nn.Linear` layers (qkv_proj,
o_proj, gate_up_proj, down_proj, lm_head) by `Int8Linear` / `Int4Linear`; the model code
is untouched. Activations stay in the model's dtype; only the stored weights shrink.

- int8: symmetric, one fp32 scale per output channel: w = scale[n] * q, q in -127..127.
- int4: asymmetric, per group of `group_size` (32) inputs: w = s * q + m, q in 0..15, s and
  m float16 (4 + 32/group_size bits per weight). Group 32 asymmetric measured best by far:
  mean KL to fp32 over tests/data/prose.txt 0.055, against 0.34 for group 64 and 0.38 for
  symmetric group 32 (the embedded checkpoint is itself Q4_1: asymmetric groups of 32).

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

import contextlib
import enum
import logging

import torch
import torch.nn.functional as F
from torch import nn

from servelm import hugepages
from servelm.kernels import load_ops

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128, 256)
# The linear layers a Llama-family model swaps (by attribute name).
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _validate(method: str | None) -> None:
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} or None, "
                         f"got {method!r}")


# ---------------------------------------------------------------- formats (pure PyTorch)

@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale fp32 [N]); symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def _pad_rows(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """t [N, ...] with rows of `fill` appended up to a multiple of 16 (whole 16-row tiles)."""
    extra = -t.shape[0] % 16
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)]) if extra else t


def int4_codec(t: torch.Tensor) -> bool:
    """Whether servelm's C++ int4 codec (kernels/csrc/int4_codec.cpp) takes t: a CPU tensor,
    the library built. It gives the PyTorch versions below bit for bit (tested), several
    times faster and without their temporaries of several bytes a weight; those stay the
    reference, and the path where nothing is compiled."""
    return t.device.type == "cpu" and load_ops("int4_codec")


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [ceil(N/16), 8K], scales, mins fp16 [ceil(N/16), K/G, 16]).

    w ~= s * q + m with q in 0..15 per group of `group_size` inputs: asymmetric (min/max
    of the group), or symmetric (m = -8 s). Rows are padded to a multiple of 16 with zeros.
    Tiled layout (see quant.cpp): tile t, block b (inputs 8b..8b+7) is 32 uint16 lanes
    L = 2r + e whose nibble j is q[16t + r, 8b + 2j + e].
    """
    N, K = weight.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if K % group_size:
        raise ValueError(f"int4 needs in_features divisible by group_size {group_size}, got {K}")
    if int4_codec(weight):
        w = weight.detach()  # bf16 as it is (a float32 copy of a 1.5B model took ~3 s)
        w = w if w.dtype in (torch.float32, torch.bfloat16) else w.float()
        return tuple(torch.ops.servelm_int4_codec.quantize(w.contiguous(), group_size, symmetric))
    return quantize_int4_reference(weight, group_size, symmetric)


@torch.no_grad()
def quantize_int4_reference(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                            symmetric: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4 in PyTorch operators alone (any device)."""
    N, K = weight.shape
    w = _pad_rows(weight.detach().float())
    T = w.shape[0] // 16
    w = w.reshape(T * 16, K // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    if symmetric:
        s = torch.maximum(-lo / 8, hi / 7).clamp_min(1e-8)
        m = -8 * s
    else:
        s = ((hi - lo) / 15).clamp_min(1e-8)
        m = lo
    # Round with the scales as they will be stored.
    s16, m16 = s.half(), m.half()
    q = torch.round((w - m16.float()[..., None]) / s16.float()[..., None]).clamp_(0, 15)
    packed = _pack_tiles(q.to(torch.int32).reshape(T * 16, K))
    tile = lambda t: t.reshape(T, 16, K // group_size).transpose(1, 2).contiguous()  # noqa: E731
    return packed, tile(s16), tile(m16)


def _pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """q int [16T, K] (0..15) -> the tiled uint8 [T, 8K] layout."""
    n16, K = q.shape
    T = n16 // 16
    q = q.reshape(T, 16, K // 8, 4, 2).permute(0, 2, 1, 4, 3)  # t, b, r, e, j
    lanes = (q[..., 0] | (q[..., 1] << 4) | (q[..., 2] << 8) | (q[..., 3] << 12))
    lanes = lanes.to(torch.int16).reshape(T, K // 8, 32)  # two's complement wrap: same bits
    return lanes.view(torch.uint8).reshape(T, 8 * K).contiguous()


_unpacked: dict[tuple, torch.Tensor] | None = None  # results kept in unpacked_once


@contextlib.contextmanager
def unpacked_once():
    """Within it, unpack_int4 and dequantize_int4 compute each result once: the tuner builds
    several methods' layouts from one int4 layer (each used to unpack it again, half of a
    fresh tuning's time; an LM head was dequantised again for the reference, amx and
    oneDNN). The results are dropped on exit; callers must not modify them."""
    global _unpacked
    outer = _unpacked
    if outer is None:
        _unpacked = {}
    try:
        yield
    finally:
        _unpacked = outer


def _once(key: tuple, tensors: tuple[torch.Tensor, ...], make) -> torch.Tensor:
    """make(), computed once per key and input tensors inside unpacked_once."""
    if _unpacked is None:
        return make()
    # An inference tensor (a slice the tuner cut from a large layer inside inference mode)
    # has no version counter; nothing writes the weights while they are unpacked.
    key = key + tuple((t.data_ptr(), -1 if t.is_inference() else t._version, tuple(t.shape),
                       t.device) for t in tensors)
    out = _unpacked.get(key)
    if out is None:
        out = _unpacked[key] = make()
    return out


def unpack_int4(packed: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
    """The tiled layout -> q uint8 [N, K] in 0..15 (N = out_features, else padded rows)."""
    q = _once(("unpack",), (packed,), lambda: _unpack_int4(packed))
    return q[:out_features] if out_features is not None else q


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    if int4_codec(packed) and packed.is_contiguous():
        return torch.ops.servelm_int4_codec.unpack(packed)
    return unpack_int4_reference(packed)


def unpack_int4_reference(packed: torch.Tensor) -> torch.Tensor:
    """unpack_int4 in PyTorch operators alone (any device), every padded row."""
    T, K8 = packed.shape
    K = K8 // 8
    # Lanes 2r and 2r + 1 (e = 0, 1) of block b as one little-endian int32 word: output column
    # 8b + 2j + e is nibble j of lane e, bits 4j + 16e (int32 shifts vectorise; a uint8
    # permute of the nibbles was 2x slower, most of a quantised model's tuning time).
    words = packed.view(torch.int32).reshape(T, K // 8, 16).transpose(1, 2).contiguous()
    shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32, device=packed.device)
    return ((words[..., None] >> shifts) & 15).to(torch.uint8).reshape(T * 16, K)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int, out_features: int | None = None,
                    dtype=torch.float32) -> torch.Tensor:
    """w = s * q + m (the product rounded in fp32, then the sum), cast to dtype."""
    if (int4_codec(packed) and dtype in (torch.float32, torch.bfloat16)
            and packed.is_contiguous() and scales.is_contiguous() and mins.is_contiguous()):
        w = _once(("dequantize", group_size, dtype), (packed, scales, mins),
                  lambda: torch.ops.servelm_int4_codec.dequantize(packed, scales, mins,
                                                                  group_size, dtype))
        return w[:out_features] if out_features is not None else w
    return _dequantize_codes(unpack_int4(packed), scales, mins, group_size, out_features, dtype)


def dequantize_int4_reference(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                              group_size: int, out_features: int | None = None,
                              dtype=torch.float32) -> torch.Tensor:
    """dequantize_int4 in PyTorch operators alone (any device)."""
    return _dequantize_codes(unpack_int4_reference(packed), scales, mins, group_size,
                             out_features, dtype)


def _dequantize_codes(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                      out_features: int | None, dtype: torch.dtype) -> torch.Tensor:
    q = q.float()
    n16, K = q.shape
    sc = scales.float().transpose(1, 2).reshape(n16, K // group_size, 1)
    mn = mins.float().transpose(1, 2).reshape(n16, K // group_size, 1)
    w = (q.reshape(n16, K // group_size, group_size) * sc + mn).reshape(n16, K)
    return w[:out_features].to(dtype) if out_features is not None else w.to(dtype)


# ---------------------------------------------------------------- CUDA layouts

# Rows up to which an int4 layer runs tinygemm on CUDA (a matrix-vector kernel at heart: it
# reads the weight once per 16 rows); past them it dequantises the whole weight
# (servelm.kernels.triton_quant) for a bf16 matmul (benchmarks/cuda_int4.py).
CUDA_INT4_MAX_ROWS = 32
# int8 layers on CUDA, bf16 / fp16 activations: up to this many rows servelm.kernels.
# triton_quant.int8_linear (the weight converted in registers); past them the weight is
# converted for one dense matmul.
CUDA_INT8_MAX_ROWS = 64


def tinygemm_operands(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      group_size: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, our tiled scales/mins) -> (uint8 [N, K/2] with element 2i
    in the high nibble of byte i, bf16 scales-and-zeros [K/G, N, 2]): the inputs of
    `aten._convert_weight_to_int4pack` and `_weight_int4pack_mm` on CUDA, which compute
    w = s * (q - 8) + z, so z = m + 8 s."""
    N = out_features
    q = q[:N].to(torch.uint8)
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
    T, KG, _ = scales.shape
    s = scales.float().transpose(1, 2).reshape(T * 16, KG)[:N]
    m = mins.float().transpose(1, 2).reshape(T * 16, KG)[:N]
    sz = torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous()
    return nibbles, sz.to(torch.bfloat16)


def dequantize_tinygemm(nibbles: torch.Tensor, scales_zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The weights [N, K] (fp32) that tinygemm computes with: the reference its operands
    are tested against."""
    q = torch.stack([nibbles >> 4, nibbles & 15], dim=-1).reshape(nibbles.shape[0], -1).float()
    N, K = q.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K/G, 2]
    w = q.reshape(N, K // group_size, group_size) - 8
    return (w * sz[..., :1] + sz[..., 1:]).reshape(N, K)


def _inner_k_tiles(K: int) -> int:
    return next((t for t in (8, 4, 2) if K % (16 * t) == 0), 0)


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


# ---------------------------------------------------------------- modules

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
    """Common parts of the quantised linear layers: shape, bias, kernel choice."""

    method = ""
    packed_tensors = ("qweight", "scales", "mins", "bias")  # what pack_weights moves

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 use_kernel: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # Decided once (None: wherever the kernels load): forward runs every step, and
        # asking the loader each call cost ~0.3 ms of a 5 ms one-stream decode step.
        self.use_kernel = kernels_available() if use_kernel is None else (
            use_kernel and kernels_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # no rows (a prompt chunk that samples nothing): CUDA's int4 and
            return x.new_zeros(*x.shape[:-1], self.out_features)  # int8 matmuls refuse those
        if not self.use_kernel or x.device.type != "cpu":
            return self._forward_fallback(x)
        if x.dtype in _KERNEL_DTYPES:
            return self._kernel(x)
        return self._kernel(x.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] (K % 4 == 0), scale [N] -> the kernel's tiled uint8 [ceil(N/16), 16K]
    and scales padded to [16 ceil(N/16)]. Tile t, block b (inputs 4b..4b+3) is 32 uint16
    lanes L = 2r + e: low byte q+128 at [16t + r, 4b + e], high byte at [16t + r, 4b + 2 + e]."""
    K = q.shape[1]
    u = _pad_rows(q.to(torch.int16) + 128, 128)
    scale = _pad_rows(scale)
    T = u.shape[0] // 16
    u = u.reshape(T, 16, K // 4, 2, 2).permute(0, 2, 1, 4, 3)  # t, b, r, e, byte
    return u.to(torch.uint8).reshape(T, 16 * K).contiguous(), scale.float().contiguous()


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    T, K16 = packed.shape
    K = K16 // 16
    u = packed.reshape(T, K // 4, 16, 2, 2).permute(0, 2, 1, 4, 3).reshape(T * 16, K)
    return (u.to(torch.int16) - 128).to(torch.int8)[:out_features]


class Int8Linear(QuantLinear):
    """Symmetric per-output-channel int8 weights.

    Stored tiled for the C++ kernel when it is available and in_features % 4 == 0, else
    row-major [N, K] int8 for PyTorch's `_weight_int8pack_mm`.
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
        if q.is_cuda:
            _cuda_triton_int8_works(q.device)  # asked now, never inside a graph capture

    @classmethod
    def from_linear(cls, linear: nn.Linear, use_kernel: bool | None = None) -> "Int8Linear":
        q, s = quantize_int8(linear.weight)
        return cls(q, s, linear.bias, use_kernel=use_kernel)

    def int8_weight(self) -> torch.Tensor:
        """q int8 [N, K], row-major."""
        return unpack_int8(self.qweight, self.out_features) if self.tiled else self.qweight

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int8(self.int8_weight(), self.scales[: self.out_features], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tiled and x.numel():
            return self._forward_fallback(x)
        return super().forward(x)

    def _kernel(self, x):
        return torch.ops.servelm_quant.int8_linear.default(x, self.qweight, self.scales,
                                                           self.out_features, self.bias)

    def _forward_fallback(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.is_cuda and not self.tiled:
            if (x.dtype in (torch.bfloat16, torch.float16)
                    and x.numel() <= CUDA_INT8_MAX_ROWS * self.in_features
                    and _cuda_triton_int8_works(x.device)):
                from servelm.kernels import triton_quant
                return triton_quant.int8_linear(x, self.qweight, self.scales, bias)
            x2 = x.reshape(-1, self.in_features)
            if x.dtype == torch.float16:  # x . q could pass fp16's 65504 before scaling
                y = F.linear(x2, self.dequantize(x.dtype))
            else:
                y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        if x.device.type == "cpu" and not self.tiled:
            # PyTorch's fused CPU kernel; scales must be in the activation dtype.
            y = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, self.in_features).contiguous(), self.qweight,
                self.scales.to(x.dtype))
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize(x.dtype), bias)


class Int4Linear(QuantLinear):
    """Group-wise asymmetric int4 weights (w = s * q + m per group of inputs), tiled."""

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
        tiles = _inner_k_tiles(self.in_features)
        if qweight.is_cuda and tiles and out_features % 8 == 0 and _cuda_int4pack_works(qweight.device):
            nibbles, sz = tinygemm_operands(unpack_int4(qweight), scales, mins, group_size,
                                            out_features)
            self.tg_weight = torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)
            self.tg_scales_zeros = sz
        if qweight.is_cuda:
            _cuda_triton_dequant_works(qweight.device)  # asked now, never inside a graph capture

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE,
                    symmetric: bool = False, use_kernel: bool | None = None) -> "Int4Linear":
        q, s, m = quantize_int4(linear.weight, group_size, symmetric)
        return cls(q, s, m, group_size, linear.out_features, linear.bias, use_kernel)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scales, self.mins, self.group_size,
                               self.out_features, dtype)

    def _kernel(self, x):
        return torch.ops.servelm_quant.int4_linear.default(
            x, self.qweight, self.scales, self.mins, self.group_size, self.out_features, self.bias)

    def _forward_fallback(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if (self.tg_weight is not None and x.dtype == torch.bfloat16
                and x.numel() <= CUDA_INT4_MAX_ROWS * self.in_features):
            y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.in_features).contiguous(),
                                                   self.tg_weight, self.group_size,
                                                   self.tg_scales_zeros)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        if x.is_cuda and _cuda_triton_dequant_works(x.device):
            from servelm.kernels import triton_quant
            w = triton_quant.dequantize_int4(self.qweight, self.scales, self.mins,
                                             self.group_size, self.out_features, x.dtype)
            return F.linear(x, w, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


# The bf16/fp32 tiled ops by weight dtype, and how many consecutive inputs a lane group holds:
# bf16 k-pairs (vdpbf16ps's operand), fp32 single k (broadcast FMAs).
TILE_OPS = {torch.bfloat16: "bf16_linear", torch.float32: "f32_linear"}
_TILE_PAIR = {torch.bfloat16: 2, torch.float32: 1}


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 or fp32 -> [ceil(N/16), 16K] of its dtype in the C++ kernels' tiles:
    tile t is K/p groups of 16 p values, lane p r + e holding w[16t + r, p g + e] (bf16:
    p = 2, K even, vdpbf16ps's operand; fp32: p = 1, vector k holding rows 16t .. 16t + 15)."""
    N, K = w.shape
    p = _TILE_PAIR[w.dtype]
    w = _pad_rows(w)
    T = w.shape[0] // 16
    return w.reshape(T, 16, K // p, p).permute(0, 2, 1, 3).reshape(T, 16 * K).contiguous()


def unpack_tiles(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_tiles' inverse: the weight [out_features, K]."""
    T, K16 = tiles.shape
    K, p = K16 // 16, _TILE_PAIR[tiles.dtype]
    return tiles.reshape(T, K // p, 16, p).permute(0, 2, 1, 3).reshape(T * 16, K)[:out_features]


class TiledLinear(QuantLinear):
    """A bf16 or fp32 model's linear layer on the C++ kernels: not a quantisation, the same
    weights in the kernels' 16-row tiles (bf16: the int4/int8 kernels' vdpbf16ps operand;
    fp32: K vectors of 16). Below 8 rows the weight streams through the dot products (bf16)
    or broadcast FMAs (fp32) once per 4 rows; from 8 rows a GEMM micro-kernel runs over the
    tiles in place. oneDNN's prepacked matmuls streamed the LM head at ~50 GB/s at one row
    here, these ~62 (bf16). bf16 layers can join the DecodeStack. Activations of the
    weight's dtype on the CPU run the kernel; anything else F.linear on the unpacked weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_kernel: bool | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias, use_kernel)
        if weight.dtype not in TILE_OPS:
            raise TypeError(f"TiledLinear takes bfloat16 or float32 weights, got {weight.dtype}")
        self.dtype = weight.dtype
        self.method = "bf16" if weight.dtype == torch.bfloat16 else "fp32"
        op = TILE_OPS[weight.dtype]
        self._op = getattr(torch.ops.servelm_quant, op).default if self.use_kernel else None
        self.register_buffer("qweight", pack_tiles(weight.detach()))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "TiledLinear":
        return cls(linear.weight, linear.bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return unpack_tiles(self.qweight, self.out_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.use_kernel and self._op is not None and x.dtype == self.dtype
                and x.device.type == "cpu"):
            return self._op(x, self.qweight, self.out_features, self.bias)
        return self._forward_fallback(x)

    def _forward_fallback(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.method} tiles"


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


class StackFormat(enum.IntEnum):
    """A linear layer's weight format as the DecodeStack takes it (decode_stack.cpp,
    namespace format): an int4 layer's code is its group size (> 0), an int4 layer in
    q8act's panels Q8ACT + its group size (int4_code / q8act_code build them)."""

    INT8 = 0
    BF16 = -1  # bf16 in the kernels' 16-row tiles
    AMX = -2  # bf16 in AMX tile order
    AMX_GATED = -3  # a SwiGLU gate_up in AMX tile order, SiLU in its epilogue (gate_silu)
    Q8ACT = 1 << 20

    @staticmethod
    def int4_code(group_size: int) -> int:
        return group_size

    @staticmethod
    def q8act_code(group_size: int) -> int:
        return StackFormat.Q8ACT + group_size


# The same codes under their earlier names.
STACK_Q8ACT = StackFormat.Q8ACT
STACK_AMX = StackFormat.AMX
STACK_AMX_GATED = StackFormat.AMX_GATED


def kernel_weights(module: nn.Module, rows: int = 1) -> tuple[list[torch.Tensor], int] | None:
    """A kernel layer's tensors as `servelm_stack.DecodeStack` takes them, with its format
    code (StackFormat); None when it does not run on the C++ kernels. A layer run by row
    bucket (BucketedLinear) answers for the module that runs a call of `rows` rows."""
    from servelm.layers.amx import AmxLinear
    from servelm.layers.q8act import Int4Q8Linear

    if hasattr(module, "module_for"):
        module = module.module_for(rows)
    if isinstance(module, Int4Q8Linear):
        return ([module.qweight, module.scales, module.mins],
                StackFormat.q8act_code(module.group_size))
    if isinstance(module, AmxLinear):
        return [module.packed], StackFormat.AMX_GATED if module.gated else StackFormat.AMX
    if isinstance(module, TiledLinear) and module.use_kernel and module.dtype == torch.bfloat16:
        return [module.qweight], StackFormat.BF16
    if isinstance(module, Int4Linear) and module.use_kernel:
        return ([module.qweight, module.scales, module.mins],
                StackFormat.int4_code(module.group_size))
    if isinstance(module, Int8Linear) and module.use_kernel and module.tiled:
        return [module.qweight, module.scales], StackFormat.INT8
    return None


# ---------------------------------------------------------------- the swap

def quantize_linear(linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                    symmetric: bool = False, use_kernel: bool | None = None) -> QuantLinear:
    _validate(method)
    if method == "int8":
        return Int8Linear.from_linear(linear, use_kernel)
    return Int4Linear.from_linear(linear, group_size, symmetric, use_kernel)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   targets: tuple[str, ...] = TARGETS, symmetric: bool = False,
                   use_kernels: bool | None = None) -> nn.Module:
    """Swap the model's target `nn.Linear` layers for quantised ones, in place.

    A tied LM head gets its own quantised copy; the embedding keeps its weight. A layer
    int4 cannot take (in_features not a multiple of group_size) is kept in int8.
    use_kernels False: the layers never run the C++ kernels (None: wherever they load).
    """
    _validate(method)
    if method == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if name in targets and type(child) is nn.Linear]
    for parent, name, child in swaps:
        m = method
        if m == "int4" and child.in_features % group_size:
            m = "int8"
        q = quantize_linear(child, m, group_size, symmetric, use_kernels)
        setattr(parent, name, q.to(child.weight.device))
    return model


def pack_weights(model: nn.Module, huge: bool = True) -> int:
    """Move every CPU layer's repacked tensors (a module's `packed_tensors`: the quantised
    layers, qdot's and panels' layouts) into one region of 2 MB huge pages (plain pages if
    not `huge`), in module order (the order a step reads them): the weight stream then
    crosses ~40 pages a step instead of ~19,000 (servelm.hugepages). Returns the bytes
    packed."""
    fields = [(m, name) for m in model.modules() if getattr(m, "packed_tensors", None)
              and getattr(m, m.packed_tensors[0]).device.type == "cpu"
              for name in m.packed_tensors if getattr(m, name, None) is not None]
    views = hugepages.pack([getattr(m, name) for m, name in fields], huge=huge)
    for (m, name), v in zip(fields, views):
        setattr(m, name, v)
    return sum(v.numel() * v.element_size() for v in views)


def quantized_bits_per_weight(method: str | None, group_size: int = DEFAULT_GROUP_SIZE,
                              dtype_bits: int = 32) -> float:
    """Bits read per weight of the quantised layers (scales included), for the roofline."""
    if method is None:
        return float(dtype_bits)
    _validate(method)
    return 8.0 if method == "int8" else 4.0 + 32.0 / group_size
