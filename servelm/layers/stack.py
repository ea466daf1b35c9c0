"""A linear layer's operands for the C++ DecodeStack (decode_stack.h): kernel_weights. Here,
above the layers it tells apart (servelm.layers.amx, .q8act and the formats in
servelm.quantization.formats), which import none of it."""

from __future__ import annotations

import torch
from torch import nn

from servelm.layers.amx import AmxLinear
from servelm.layers.q8act import Int4Q8Linear
from servelm.quantization.formats import (STACK_AMX, STACK_AMX_GATED, STACK_Q8ACT, Int4Linear,
                                          Int8Linear, TiledLinear)


def kernel_weights(module: nn.Module, rows: int = 1) -> tuple[list[torch.Tensor], int] | None:
    """A kernel layer's tensors as `servelm_quant.DecodeStack` takes them, with its int4
    group size (0 for int8, -1 for bf16 tiles, STACK_AMX for bf16 in AMX tile order,
    STACK_AMX_GATED for a gate_silu() gate_up in it, STACK_Q8ACT + the group size for int4
    in q8act's panels); None when it does not run on the C++ kernels. A layer run by row
    bucket (BucketedLinear) answers for the module that runs a call of `rows` rows."""
    if hasattr(module, "module_for"):
        module = module.module_for(rows)
    if isinstance(module, Int4Q8Linear):
        return [module.qweight, module.scales, module.mins], STACK_Q8ACT + module.group_size
    if isinstance(module, AmxLinear):
        return [module.packed], STACK_AMX_GATED if module.gated else STACK_AMX
    if isinstance(module, TiledLinear) and module.use_kernel and module.dtype == torch.bfloat16:
        return [module.qweight], -1
    if isinstance(module, Int4Linear) and module.use_kernel:
        return [module.qweight, module.scales, module.mins], module.group_size
    if isinstance(module, Int8Linear) and module.use_kernel and module.tiled:
        return [module.qweight, module.scales], 0
    return None
