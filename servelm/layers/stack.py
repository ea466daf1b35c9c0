"""A linear layer's operands for the C++ DecodeStack (csrc/decode_stack.cpp): its weight
format's code (StackFormat) and kernel_weights. Here, above the layers it tells apart
(servelm.layers.amx, .q8act and the formats in servelm.quantization.formats), which import
none of it."""

from __future__ import annotations

import enum

import torch
from torch import nn

from servelm.layers.amx import AmxLinear
from servelm.layers.lora import LoRALinear
from servelm.layers.q8act import Int4Q8Linear
from servelm.layers.w8a8 import W8A8Linear
from servelm.quantization.formats import Int4Linear, Int8Linear, TiledLinear


class StackFormat(enum.IntEnum):
    """A linear layer's weight format as the DecodeStack takes it (decode_stack.cpp,
    namespace format): an int4 layer's code is its group size (> 0), an int4 layer in
    q8act's panels Q8ACT + its group size (int4_code / q8act_code build them)."""

    INT8 = 0
    BF16 = -1  # bf16 in the kernels' 16-row tiles
    AMX = -2  # bf16 in AMX tile order
    AMX_GATED = -3  # a SwiGLU gate_up in AMX tile order, SiLU in its epilogue (gate_silu)
    NONE = -4  # no such linear (a layer's absent extra linear: an attention without output gate)
    Q8ACT = 1 << 20
    W8A8 = 2 << 20
    W8A8_PAIRS = 3 << 20  # w8a8's panels, run by its pair form

    @staticmethod
    def int4_code(group_size: int) -> int:
        return group_size

    @staticmethod
    def q8act_code(group_size: int) -> int:
        return StackFormat.Q8ACT + group_size

    @staticmethod
    def w8a8_code(block: int, pairs: bool = False) -> int:
        return (StackFormat.W8A8_PAIRS if pairs else StackFormat.W8A8) + block


def base_linear(module: nn.Module) -> nn.Module:
    """The linear layer that computes module's matmul: an adapted layer's (LoRALinear) base."""
    return module.base if isinstance(module, LoRALinear) else module


def kernel_weights(module: nn.Module, rows: int = 1) -> tuple[list[torch.Tensor], int] | None:
    """A kernel layer's tensors as `servelm_stack.DecodeStack` takes them, with its format
    code (StackFormat); None when it does not run on the C++ kernels. A layer run by row
    bucket (BucketedLinear) answers for the module that runs a call of `rows` rows; an adapted
    one (LoRALinear) for its base (the stack binds its adapters apart: bind_lora)."""
    module = base_linear(module)
    if hasattr(module, "module_for"):
        module = module.module_for(rows)
    if isinstance(module, Int4Q8Linear):
        return ([module.qweight, module.scales, module.mins],
                StackFormat.q8act_code(module.group_size))
    if isinstance(module, AmxLinear):
        return [module.packed], StackFormat.AMX_GATED if module.gated else StackFormat.AMX
    if isinstance(module, W8A8Linear) and not module.tiles:  # the tile form: per op
        return ([module.weight, module.weight_scale, module.inv_scale],
                StackFormat.w8a8_code(module.block, module.pairs))
    if isinstance(module, TiledLinear) and module.use_kernel and module.dtype == torch.bfloat16:
        return [module.qweight], StackFormat.BF16
    if isinstance(module, Int4Linear) and module.use_kernel:
        return ([module.qweight, module.scales, module.mins],
                StackFormat.int4_code(module.group_size))
    if isinstance(module, Int8Linear) and module.use_kernel and module.tiled:
        return [module.qweight, module.scales], StackFormat.INT8
    return None
