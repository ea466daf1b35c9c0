"""Gemma 4 (text): Gemma 3's layer (sandwich norms, per-head q/k norms, GeGLU, embeddings
times sqrt(hidden), sliding and global layers with their own rotary) with

- plain w RMSNorms (not Gemma 3's 1 + w), a softmax scale of 1, and a weightless RMS norm
  of each head's v (v_norm),
- global layers with their own head size (global_head_dim) and, with attention_k_eq_v,
  their own KV-head count (num_global_key_value_heads) and no v_proj: the value is the key
  projection as projected, before the k norm and the rotary; transformers 5.25 writes both
  as per_layer_config (layer -> head_dim / num_key_value_heads),
- the global layers' "proportional" rotary: the first partial_rotary_factor of the head's
  frequencies turn (exponents over the whole head), the rest are 0,
- per-layer inputs (hidden_size_per_layer_input: ple.py) added through a gate at the end
  of each layer, then the whole residual stream times the layer's layer_scalar,
- the last num_kv_shared_layers layers attending the K/V of the last earlier layer of
  their kind (no k / v projections, no cache of their own), their MLP twice as wide with
  use_double_wide_mlp,
- with enable_moe_block, routed experts beside every layer's dense MLP
  (moe.ExpertsBesideMLP: their router on the residual stream, softmax top-k renormalised
  and times a per-expert scale), final logits soft-capped where the config says.

The multimodal Gemma4ForConditionalGeneration keeps the text config in text_config and the
text model's tensors under model.language_model. (the vision and audio towers and their
embedders are not read). No GGUF yet; tensor parallelism is refused."""

from __future__ import annotations

import re

from servelm.models.family import Family
from servelm.models.hf_keys import FULL, SLIDING, rope_scaling

# transformers' Gemma4TextConfig defaults, for keys a config.json leaves out.
DEFAULTS = dict(head_dim=256, num_key_value_heads=4, rms_norm_eps=1e-6, sliding_window=512,
                max_position_embeddings=131072, hidden_size_per_layer_input=256,
                vocab_size_per_layer_input=262144, global_head_dim=512,
                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1000000.0}}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu",
                "silu": "silu"}
# The multimodal checkpoint's towers and their projections into the text model.
_OTHER_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                 "model.embed_audio.")
# A layer's MoE block, as transformers names it -> the decoder's (moe.ExpertsBesideMLP).
_MOE_NAMES = {"router.proj.weight": "moe.experts.gate.weight",
              "router.scale": "moe.experts.router_scale",
              "router.per_expert_scale": "moe.experts.per_expert_scale",
              "experts.gate_up_proj": "moe.experts.experts_gate_up",
              "experts.down_proj": "moe.experts.experts_down"}
_MOE_RE = re.compile(r"(layers\.\d+\.)(" + "|".join(map(re.escape, _MOE_NAMES)) + ")")
_PLE = ("embed_tokens_per_layer.", "per_layer_model_projection.", "per_layer_projection_norm.")


def _get(cfg: dict, key: str):
    value = cfg.get(key)
    return DEFAULTS[key] if value is None and key in DEFAULTS else value


def _layer_shapes(cfg: dict, types: tuple[str, ...]) -> dict[int, dict]:
    """Layer -> its head_dim / num_key_value_heads overrides (per_layer_config, else
    global_head_dim and, with attention_k_eq_v, num_global_key_value_heads on the global
    layers, as transformers derives them)."""
    per = cfg.get("per_layer_config")
    if per is None:
        over = {"head_dim": _get(cfg, "global_head_dim")}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        return {i: over for i, t in enumerate(types) if t == FULL}
    out = {}
    for key, over in per.items():
        bad = set(over) - {"head_dim", "num_key_value_heads"}
        if bad:
            raise ValueError(f"per_layer_config[{key}] overrides {sorted(bad)}, which servelm "
                             f"does not support for Gemma 4 (only head_dim, num_key_value_heads)")
        out[int(key)] = over
    return out


def _kv_sources(types: tuple[str, ...], shared: int) -> tuple[int, ...]:
    """Each layer's KV source: itself, or for the last `shared` layers the last earlier
    layer of the same kind (transformers' kv_sharing_modes)."""
    n = len(types)
    if not shared:
        return ()
    if not 0 < shared < n:
        raise ValueError(f"num_kv_shared_layers={shared} must be below num_hidden_layers={n}")
    first = n - shared
    out = list(range(n))
    for i in range(first, n):
        src = next((j for j in range(first - 1, -1, -1) if types[j] == types[i]), None)
        if src is None:
            raise ValueError(f"num_kv_shared_layers={shared}: layer {i} ({types[i]}) has no "
                             f"earlier {types[i]} layer to share the KV cache of")
        out[i] = src
    return tuple(out)


class Gemma4(Family):
    name = "gemma4"
    architectures = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
    # The checkpoint's post_attention_layernorm comes after attention (a sandwich norm), its
    # pre_feedforward_layernorm is the decoder's post_attention_layernorm (as Gemma 3); the
    # MoE block's norms and the per-layer input's modules are the decoder's moe / per_layer_input.
    renames = {"post_attention_layernorm": "attn_out_norm",
               "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "mlp_out_norm",
               "post_feedforward_layernorm_1": "moe.mlp_norm",
               "pre_feedforward_layernorm_2": "moe.input_norm",
               "post_feedforward_layernorm_2": "moe.out_norm",
               "per_layer_input_gate": "per_layer_input.gate",
               "per_layer_projection": "per_layer_input.proj",
               "post_per_layer_input_norm": "per_layer_input.norm"}
    tensor_parallel = False  # per-layer KV shapes and shared caches have no sharded form yet

    # ---- the multimodal checkpoint's text model (read by the loader) -------------------------

    @staticmethod
    def hf_ignored(key: str) -> bool:
        """The multimodal checkpoint's vision and audio towers and their embedders."""
        return key.startswith(_OTHER_TOWERS)

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' (every token attending every "
                             "other) is not supported: servelm's attention is causal")
        types = list(cfg.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING
                                                for i in range(n)])
        if types:
            types[-1] = FULL  # transformers forces the last layer global
        types = tuple(types)
        act = _get(cfg, "hidden_activation")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 4 "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
        rope = cfg.get("rope_parameters") or DEFAULT_ROPE
        if FULL not in rope and SLIDING not in rope:  # one set for both kinds
            rope = {FULL: rope, SLIDING: rope}
        local = rope.get(SLIDING) or DEFAULT_ROPE[SLIDING]
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention rope_type "
                             f"{local.get('rope_type')!r} is not supported for Gemma 4 "
                             f"(the sliding layers' rotary: default)")
        full = rope.get(FULL) or DEFAULT_ROPE[FULL]
        head_dim = _get(cfg, "head_dim")
        kv_heads = _get(cfg, "num_key_value_heads")
        shapes = _layer_shapes(cfg, types)
        dims = tuple(shapes.get(i, {}).get("head_dim", head_dim) for i in range(n))
        heads = tuple(shapes.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(n))
        for kind in (FULL, SLIDING):  # one rotary table a kind: one head size a kind
            if len({d for d, t in zip(dims, types) if t == kind}) > 1:
                raise ValueError(f"Gemma 4's {kind} layers have different head sizes")
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        sources = _kv_sources(types, shared)
        inter = cfg["intermediate_size"]
        extra = {"v_norm": True, "layer_scalar": True,
                 "k_eq_v_layers": tuple(i for i, t in enumerate(types)
                                        if t == FULL and cfg.get("attention_k_eq_v"))}
        if shared and cfg.get("use_double_wide_mlp"):  # the KV-shared layers' MLPs
            extra["intermediate_sizes"] = tuple(inter * (2 if s != i else 1)
                                                for i, s in enumerate(sources))
        ple = _get(cfg, "hidden_size_per_layer_input")
        if ple and _get(cfg, "vocab_size_per_layer_input") < base["vocab_size"]:
            # transformers has no row for the other ids either (it fails on them)
            raise ValueError(f"vocab_size_per_layer_input="
                             f"{_get(cfg, 'vocab_size_per_layer_input')} is below vocab_size="
                             f"{base['vocab_size']}: the per-layer inputs lack rows for some "
                             f"token ids")
        if ple:
            extra.update(per_layer_input_size=int(ple),
                         per_layer_vocab_size=int(_get(cfg, "vocab_size_per_layer_input")))
        moe = {}
        if cfg.get("enable_moe_block"):
            for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not cfg.get(key):
                    raise ValueError(f"enable_moe_block needs {key}")
            moe = dict(num_experts=int(cfg["num_experts"]),
                       num_experts_per_tok=int(cfg["top_k_experts"]),
                       moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                       norm_topk_prob=True)
            extra["moe_beside_mlp"] = True
        cap = cfg.get("final_logit_softcapping")
        bias = bool(cfg.get("attention_bias", False))
        return {"head_dim": head_dim, "num_kv_heads": kv_heads,
                "rms_norm_eps": float(_get(cfg, "rms_norm_eps")),
                "max_position_embeddings": int(_get(cfg, "max_position_embeddings")),
                "tie_word_embeddings": bool(_get(cfg, "tie_word_embeddings")),
                "attention_bias": bias, "attention_out_bias": bias,
                "qk_norm": True, "sandwich_norms": True, "hidden_act": _ACTIVATIONS[act],
                "embed_scale": base["hidden_size"] ** 0.5, "attn_scale": 1.0,
                "layer_types": types, "sliding_window": int(_get(cfg, "sliding_window")),
                "rope_theta": float(full.get("rope_theta") or 1000000.0),
                "rope_scaling": rope_scaling({"rope_parameters": {FULL: full},
                                              "max_position_embeddings":
                                                  _get(cfg, "max_position_embeddings")}),
                "rope_local_theta": float(local.get("rope_theta") or 10000.0),
                "final_logit_softcap": float(cap) if cap else None,
                "layer_head_dims": dims if len(set(dims)) > 1 or dims[0] != head_dim else (),
                "layer_kv_heads": heads if len(set(heads)) > 1 or heads[0] != kv_heads else (),
                "kv_source_layers": sources, **moe, "extra": extra}

    # ---- names -------------------------------------------------------------------------------

    def internal_name(self, hf_name):
        # The multimodal checkpoint's text model: model.language_model.*, lm_head.
        name = hf_name.removeprefix("model.language_model.").removeprefix("model.")
        if name.startswith(_PLE):  # the per-layer inputs' model-level tensors
            return f"per_layer_embed.{name}"
        name = super().internal_name(name)
        return _MOE_RE.sub(lambda m: m.group(1) + _MOE_NAMES[m.group(2)], name)
