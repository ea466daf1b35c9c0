"""Model surgery: a model's linear layers swapped for quantised ones (quantize_model), by
attribute name (TARGETS); the model code is untouched."""

from __future__ import annotations

import torch
from torch import nn

from servelm.quantization.formats import Int4Linear, Int8Linear, QuantLinear
from servelm.quantization.numerics import DEFAULT_GROUP_SIZE, GROUP_SIZES, check_method

# The linear layers a Llama-family model swaps (by attribute name).
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "c_fc", "c_proj", "lm_head",
           # linear attention's projections and an attention output gate (Qwen3-Next)
           "in_proj_qkvz", "out_proj", "attn_gate",
           # per-layer inputs' projections (Gemma 4's PLE)
           "per_layer_model_projection", "input_gate", "input_proj")


def quantize_linear(linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                    symmetric: bool = False, use_kernel: bool | None = None) -> QuantLinear:
    check_method(method)
    if method == "int8":
        return Int8Linear.from_linear(linear, use_kernel)
    return Int4Linear.from_linear(linear, group_size, symmetric, use_kernel)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   targets: tuple[str, ...] = TARGETS, symmetric: bool = False,
                   use_kernels: bool | None = None) -> nn.Module:
    """Swap the model's target `nn.Linear` layers for quantised ones, in place.

    A tied LM head gets its own quantised copy; the embedding keeps its weight. A layer
    int4 cannot take (in_features not a multiple of group_size) is kept in int8;
    mixture-of-experts layers' routed experts are quantised too (SparseMoE.quantize_experts).
    use_kernels False: the layers never run the C++ kernels (None: wherever they load).
    """
    check_method(method)
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
    from servelm.models.moe import SparseMoE

    for m in model.modules():  # routed experts: the format asked for, in their own layouts
        if isinstance(m, SparseMoE):
            m.quantize_experts(method)
    return model
