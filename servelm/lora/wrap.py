"""The model's adaptable linear layers wrapped in LoRALinears (servelm.layers.lora), once its
weights are final."""

from __future__ import annotations

from torch import nn

from servelm.layers.lora import LoRALinear, LoRAStep


def adaptable_layers(model: nn.Module) -> list[tuple[str, nn.Module, str, tuple[int, ...], int]]:
    """(module path, parent, attribute, parts' widths, in_features) of every linear layer an
    adapter may adapt: each decoder layer's attention projections (a gated DeltaNet's
    too) and its dense gated MLP (a routed-experts MLP keeps its experts unadapted)."""
    from servelm.models.layers import MLP, Attention, GatedMLP
    from servelm.models.linear_attention import GatedDeltaNet

    out = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)  # (none: a linear-attention layer)
        if isinstance(attn, Attention):
            # Its parts: q, k and v, or fewer (Gemma 4: K=V layers, KV-shared layers).
            kv = (attn.kv_size,) * (len(attn.qkv_parts) - 1)
            out.append((f"layers.{i}.self_attn.qkv_proj", attn, "qkv_proj",
                        (attn.q_size, *kv), attn.options["hidden"]))
            if attn.attn_gate is not None:  # its rows of the checkpoint's q_proj (loader)
                out.append((f"layers.{i}.self_attn.attn_gate", attn, "attn_gate",
                            (attn.q_size,), attn.options["hidden"]))
            out.append((f"layers.{i}.self_attn.o_proj", attn, "o_proj",
                        (attn.options["hidden"],), attn.q_size))
        lin = getattr(layer, "linear_attn", None)
        if isinstance(lin, GatedDeltaNet):
            h = lin.in_proj_qkvz.in_features
            out.append((f"layers.{i}.linear_attn.in_proj_qkvz", lin, "in_proj_qkvz",
                        (lin.conv_dim, lin.value_dim), h))
            out.append((f"layers.{i}.linear_attn.in_proj_ba", lin, "in_proj_ba",
                        (lin.num_v_heads, lin.num_v_heads), h))
            out.append((f"layers.{i}.linear_attn.out_proj", lin, "out_proj", (h,),
                        lin.value_dim))
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MLP):  # not gated: up (c_fc) and down (c_proj)
            h = mlp.options["hidden"]
            out.append((f"layers.{i}.mlp.c_fc", mlp, "c_fc", (mlp.intermediate,), h))
            out.append((f"layers.{i}.mlp.c_proj", mlp, "c_proj", (h,), mlp.intermediate))
        if isinstance(mlp, GatedMLP):
            out.append((f"layers.{i}.mlp.gate_up_proj", mlp, "gate_up_proj",
                        (mlp.intermediate, mlp.intermediate), mlp.options["hidden"]))
            out.append((f"layers.{i}.mlp.down_proj", mlp, "down_proj",
                        (mlp.options["hidden"],), mlp.intermediate))
    return out


def apply_lora(model: nn.Module, max_loras: int, max_rank: int,
               huge: bool = True) -> dict[str, LoRALinear]:
    """Wrap every adaptable linear layer of `model` (weights final: loaded, quantised, tuned;
    a SwiGLU gate_up gated by its amx method too: its forward still returns gate and up, and
    the DecodeStack adds the delta before the SiLU) in a LoRALinear with
    max_loras empty slots of rank max_rank; `model.lora_step` is their shared LoRAStep.
    On the CPU the slots lie in one region of 2 MB huge pages (plain pages if not `huge`),
    in the order a step reads them, as the weights do (servelm.hugepages): an adapted step
    streams its adapters' A and B beside the weights.
    Returns the wrapped layers by module path (the adapter loader's names)."""
    step = LoRAStep()
    dtype = model.norm.weight.dtype
    device = model.norm.weight.device
    wrapped = {}
    for path, parent, attr, parts, k in adaptable_layers(model):
        base = getattr(parent, attr)
        mod = LoRALinear(base, parts, k, max_loras, max_rank, dtype, device, step)
        setattr(parent, attr, mod)
        wrapped[path] = mod
    if device.type == "cpu" and wrapped:
        from servelm.hugepages import pack

        mods = list(wrapped.values())
        views = pack([t for m in mods for t in (m.lora_a, m.lora_b)], huge=huge)
        for i, m in enumerate(mods):
            m.lora_a, m.lora_b = views[2 * i], views[2 * i + 1]
    model.lora_step = step
    return wrapped
