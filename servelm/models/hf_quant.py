"""Pre-quantised Hugging Face checkpoints: AWQ, GPTQ and compressed-tensors integer weights.

servelm runs its own int4 / int8 weight formats (servelm.quantization), so a quantised
checkpoint is read as what it is (`HFQuant`, from config.json's quantization_config: which
format to run it in by default) and each packed linear layer is unpacked here to its dense
weight, exactly (q - z) * s in fp32, for the engine to quantise again in its own layout.

Layouts (weight W of a linear layer is [out, in]):
  AWQ (AutoAWQ GEMM): qweight [in, out/8] int32, eight 4-bit values per int32 holding columns
    [0, 2, 4, 6, 1, 3, 5, 7] of their block of 8 in nibbles 0..7; qzeros [groups, out/8] the
    same way; scales [groups, out]; groups of consecutive input rows.
  GPTQ (auto-gptq / GPTQModel): qweight [in * bits / 32, out] int32, input rows packed in
    order from the low bits; qzeros [groups, out * bits / 32] packed in order along the
    outputs, stored minus one in the v1 format ("gptq"), as is in "gptq_v2"; scales
    [groups, out]; g_idx [in]: input row -> its group (act-order checkpoints permute them).
  compressed-tensors: weight int8 [out, in] ("int-quantized" / "naive-quantized") or
    weight_packed [out, ceil(in * bits / 32)] int32 ("pack-quantized": values offset by
    2^(bits-1), packed in order from the low bits) with weight_shape; weight_scale [1],
    [out, 1] (per channel) or [out, groups]; optional weight_zero_point (packed along the
    outputs when packed) and weight_g_idx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("unquantised weights, AWQ (4-bit GEMM), GPTQ (2-, 4- or 8-bit) and "
             "compressed-tensors integer weights (int-, naive- or pack-quantized)")

# AutoAWQ packs column order_map[i] of each block of 8 into nibble i; natural column k is
# therefore in nibble _AWQ_NIBBLE[k].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE = tuple(_AWQ_ORDER.index(k) for k in range(8))

# Checkpoint tensor suffixes of one packed linear layer, per method; the dense weight
# replaces them as "<prefix>.weight".
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PARTS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
             "weight_g_idx")
# Activation and KV-cache calibration that servelm, quantising weights only, does not use.
_CT_UNUSED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point",
              "k_scale", "v_scale")


@dataclass(frozen=True)
class HFQuant:
    """A checkpoint's quantisation as config.json states it."""

    method: str            # "awq" | "gptq" | "compressed-tensors"
    bits: int              # the widest weight width in the checkpoint
    group_size: int | None  # None: per channel, or several sizes (read from the shapes)
    zero_offset: int = 0   # added to stored zero points (GPTQ v1: 1)
    detail: str = ""       # for the log: act-order, strategy, ...

    def native(self) -> tuple[str, str]:
        """servelm's weight format for it and a one-line description."""
        fmt = "int4" if self.bits <= 4 else "int8"
        name = {"awq": "AWQ", "gptq": "GPTQ"}.get(self.method, self.method)
        groups = f", groups of {self.group_size}" if self.group_size else ""
        return fmt, f"{name} {self.bits}-bit{groups}{self.detail}: {fmt} weights"


def read_quant_config(cfg: dict[str, Any]) -> HFQuant | None:
    """config.json (a dict) -> its HFQuant, None when unquantised; ValueError naming the
    method for a format servelm does not load."""
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "gguf":
        # transformers' mark on a model it dequantised from a GGUF: the weights are dense.
        return None
    if method == "awq":
        return _awq(q)
    if method == "gptq":
        return _gptq(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ValueError(f"quantization method {method or '(unnamed)'!r} is not supported: "
                     f"servelm loads {SUPPORTED}")


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what} is not supported: servelm loads {SUPPORTED}")


def _awq(q: dict[str, Any]) -> HFQuant:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise _unsupported(f"AWQ with {bits}-bit weights")
    # exllama and ipex checkpoints are stored in the GEMM layout; the others are not.
    if version not in ("gemm", "exllama", "ipex") or q.get("backend") == "llm-awq":
        raise _unsupported(f"AWQ version {q.get('backend') or version!r}")
    if q.get("zero_point") is False:
        raise _unsupported("AWQ without zero points")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return HFQuant("awq", bits, group if group > 0 else None)


def _gptq(q: dict[str, Any]) -> HFQuant:
    bits = int(q.get("bits", 4))
    fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
    if bits not in (2, 4, 8):
        raise _unsupported(f"GPTQ with {bits}-bit weights")
    if fmt not in ("gptq", "gptq_v2") or q.get("is_marlin_format"):
        raise _unsupported(f"GPTQ checkpoint format {fmt!r}")
    group = int(q.get("group_size", 128))
    detail = ", act-order" if q.get("desc_act") else ""
    return HFQuant("gptq", bits, group if group > 0 else None,
                   zero_offset=1 if fmt == "gptq" else 0, detail=detail)


def _compressed_tensors(q: dict[str, Any]) -> HFQuant:
    fmt = str(q.get("format", "")).lower()
    if fmt not in ("int-quantized", "naive-quantized", "pack-quantized"):
        raise _unsupported(f"compressed-tensors format {fmt or '(none)'!r}")
    sparsity = (q.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise _unsupported(f"compressed-tensors sparsity {sparsity!r}")
    weights = [g.get("weights") for g in (q.get("config_groups") or {}).values()]
    weights = [w for w in weights if w]
    if not weights:
        raise _unsupported("compressed-tensors without quantised weights")
    for w in weights:
        if str(w.get("type", "int")).lower() != "int":
            raise _unsupported(f"compressed-tensors {w.get('type')} weights")
    bits = max(int(w.get("num_bits", 8)) for w in weights)
    if bits > 8:
        raise _unsupported(f"compressed-tensors {bits}-bit weights")
    groups = {w.get("group_size") for w in weights if w.get("strategy") == "group"}
    group = groups.pop() if len(groups) == 1 and len(weights) == 1 else None
    strategies = sorted({str(w.get("strategy", "tensor")) for w in weights})
    return HFQuant("compressed-tensors", bits, int(group) if group else None,
                   detail=f" ({fmt}, {'/'.join(strategies)})")


# ---- which checkpoint tensors form one packed layer -------------------------------------------

def quantised_layers(quant: HFQuant, names: list[str]) -> tuple[dict[str, dict[str, str]],
                                                                   set[str]]:
    """Checkpoint names -> ({layer prefix: {part: name}} for each packed layer, the names of
    calibration tensors to skip)."""
    if quant.method in ("awq", "gptq"):
        parts, anchor, unused = _GPTQ_PARTS, "qweight", ()
    else:
        parts, anchor, unused = _CT_PARTS, "weight_scale", _CT_UNUSED
    split = [(name.rpartition(".")[0], name.rpartition(".")[2], name) for name in names]
    prefixes = {prefix for prefix, part, _ in split if part == anchor}
    layers: dict[str, dict[str, str]] = {p: {} for p in prefixes}
    for prefix, part, name in split:
        if prefix in layers and part in parts:
            layers[prefix][part] = name
    skip = {name for _, part, name in split if part in unused}
    return layers, skip


def dense_weight(quant: HFQuant, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One packed layer's tensors (by part name) -> its dense weight [out, in], fp32 (a
    float weight stored as is, in a compressed-tensors checkpoint, is returned unchanged)."""
    if quant.method == "awq":
        return unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"])
    if quant.method == "gptq":
        return unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"],
                           parts.get("g_idx"), quant.bits, quant.group_size, quant.zero_offset)
    return dequant_compressed(parts, quant.bits, quant.group_size)


# ---- unpacking -------------------------------------------------------------------------------

def _fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `bits`-wide unsigned fields of an int32 tensor, low bits first, laid out in order
    along `dim` (which grows 32 / bits times)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    dim = dim % packed.dim()
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = shifts.numel()
    out = (packed.unsqueeze(dim + 1) >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= shifts.numel()
    return out.reshape(shape)


def _check_rows(what: str, n: int, groups: torch.Tensor, n_groups: int) -> None:
    if groups.numel() != n or int(groups.max()) >= n_groups or int(groups.min()) < 0:
        raise ValueError(f"{what}: the group index does not fit {n} inputs in "
                         f"{n_groups} groups")


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
               ) -> torch.Tensor:
    """AutoAWQ GEMM (4-bit) -> W [out, in] = (q - z) * s, groups of consecutive inputs."""
    n_in, n_groups, n_out = qweight.shape[0], scales.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != n_out or qzeros.shape != (n_groups, qweight.shape[1]) \
            or n_in % n_groups:
        raise ValueError(f"AWQ shapes do not match: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    order = torch.tensor(_AWQ_NIBBLE, device=qweight.device)

    def natural(packed: torch.Tensor) -> torch.Tensor:
        fields = _fields(packed, 4, -1).view(packed.shape[0], -1, 8)
        return fields.index_select(2, order).reshape(packed.shape[0], -1)

    q, z = natural(qweight), natural(qzeros)  # [in, out], [groups, out]
    group = n_in // n_groups
    w = (q.view(n_groups, group, n_out) - z.unsqueeze(1)).float() \
        * scales.float().unsqueeze(1)
    return w.view(n_in, n_out).t().contiguous()


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int | None,
                zero_offset: int = 1) -> torch.Tensor:
    """GPTQ (v1: zero_offset 1, v2: 0) -> W [out, in] = (q - (z + offset)) * s, each input
    row in the group g_idx names (consecutive groups of group_size without one)."""
    per = 32 // bits
    n_in, n_groups, n_out = qweight.shape[0] * per, scales.shape[0], scales.shape[1]
    if qweight.shape[1] != n_out or qzeros.shape != (n_groups, n_out // per):
        raise ValueError(f"GPTQ shapes do not match: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    if g_idx is None:
        g_idx = torch.arange(n_in, device=qweight.device) // (group_size or n_in)
    g_idx = g_idx.long()
    _check_rows("GPTQ", n_in, g_idx, n_groups)
    q = _fields(qweight, bits, 0)                    # [in, out]
    z = _fields(qzeros, bits, 1) + zero_offset       # [groups, out]
    w = (q - z.index_select(0, g_idx)).float() * scales.float().index_select(0, g_idx)
    return w.t().contiguous()


def dequant_compressed(parts: dict[str, torch.Tensor], bits: int, group_size: int | None
                       ) -> torch.Tensor:
    """compressed-tensors -> W [out, in] = (q - zero point) * scale, per tensor, output
    channel or group of inputs."""
    if "weight_packed" in parts:
        out_f, in_f = (int(x) for x in parts["weight_shape"].tolist())
        offset = 1 << (bits - 1)
        q = _fields(parts["weight_packed"], bits, 1)[:, :in_f] - offset
    else:
        q = parts["weight"]
        if q.is_floating_point():  # stored dequantised (a layer left in float)
            return q
        out_f, in_f = q.shape
        q = q.int()
    scale = parts["weight_scale"].float()
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(scale.shape[0], -1)
    zero = parts.get("weight_zero_point")
    if zero is not None:
        if "weight_packed" in parts and zero.shape != parts["weight_scale"].shape:
            zero = _fields(zero, bits, 0)[:out_f] - (1 << (bits - 1))  # packed by outputs
        zero = zero.int().reshape(scale.shape)
    n_groups = scale.shape[1]
    if n_groups > 1:  # groups of inputs: one scale column each
        if "weight_g_idx" in parts:
            cols = parts["weight_g_idx"].long()
        else:
            size = group_size if group_size and math.ceil(in_f / group_size) == n_groups \
                else in_f // n_groups
            cols = torch.arange(in_f, device=q.device) // size
        _check_rows("compressed-tensors", in_f, cols, n_groups)
        scale = scale.index_select(1, cols)
        zero = None if zero is None else zero.index_select(1, cols)
    if q.shape != (out_f, in_f) or scale.shape[0] not in (1, out_f):
        raise ValueError(f"compressed-tensors shapes do not match: weight {tuple(q.shape)}, "
                         f"scale {tuple(parts['weight_scale'].shape)}")
    if zero is not None:
        q = q - zero
    return q.float() * scale
