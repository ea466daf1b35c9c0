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
embedders are not read).

Tensor parallelism splits each layer by its own heads and width (sharding.ShardPlan's plan
a layer): a global layer's KV heads (shared by the ranks where there are fewer than they),
a double-wide MLP's intermediate; the experts beside the MLP like any routed experts, the
router, the per-layer inputs and their table replicated.

GGUF: llama.cpp's `gemma4`. The file states the layer kinds (attention.sliding_window_pattern,
true: sliding), the sliding and global head sizes (key_length_swa, key_length), the KV heads
(head_count_kv, an array a layer where the global layers differ), the KV-shared layers
(shared_kv_layers), the MLP widths (feed_forward_length, an array where the shared layers'
are double) and the per-layer input width; the K=V global layers are those without attn_v;
the global layers' "proportional" rotary is its rope_freqs tensor (1 for a frequency that
turns, 1e30 for one that does not); the router's scale and the per-expert scales are the
ffn_gate_inp and ffn_down_exps `.scale` tensors. Norms are stored as they are (no 1 + w). The
per-layer embedding table keeps the checkpoint's rows past the vocabulary (the converter cuts
only token_embd's): they are dropped on load."""

from __future__ import annotations

import re

import dataclasses

from servelm.models.family import Family
from servelm.models.hf_keys import FULL, SLIDING, rope_scaling, window_pattern

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
# llama.cpp's gemma4 tensors -> HF names: a layer's (blk.N.<part>.<kind>) and the model's.
_GGUF_LAYER = {("ffn_gate_inp", "scale"): "router.scale",
               ("ffn_down_exps", "scale"): "router.per_expert_scale",
               ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
               ("ffn_down_exps", "weight"): "experts.down_proj",
               ("layer_output_scale", "weight"): "layer_scalar"}
_GGUF_GLOBAL = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}


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
               "per_layer_input_gate": "per_layer_input.input_gate",
               "per_layer_projection": "per_layer_input.input_proj",
               "post_per_layer_input_norm": "per_layer_input.norm"}
    gguf_architectures = ("gemma4",)
    gguf_layer_names = {"post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm",
                        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                        "post_ffw_norm_1": "post_feedforward_layernorm_1",
                        "post_ffw_norm_2": "post_feedforward_layernorm_2",
                        "ffn_gate_inp": "router.proj",
                        "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                        "post_norm": "post_per_layer_input_norm"}

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

    def gguf_config(self, get, base, tensor_names):
        """The file's keys as the HF config that hf_config reads (the global layers' rotary
        comes from the rope_freqs tensor afterwards: gguf_rope_freqs)."""
        n = base["num_layers"]
        pattern = get("attention.sliding_window_pattern")
        types = list(window_pattern(pattern, n) if pattern is not None else
                     (FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)))
        types[-1] = FULL  # as hf_config (transformers forces the last layer global)
        types = tuple(types)
        shared = int(get("attention.shared_kv_layers", 0) or 0)
        sources = _kv_sources(types, shared) or tuple(range(n))
        own_full = [i for i, t in enumerate(types) if t == FULL and sources[i] == i]
        # K=V global layers: the file has no v projection there (KV-shared layers have none).
        k_eq_v = bool(own_full) and all(f"blk.{i}.attn_v.weight" not in tensor_names
                                        for i in own_full)
        kv = get("attention.head_count_kv", base["num_heads"])
        kv = list(kv) if isinstance(kv, (list, tuple)) else [int(kv)] * n
        sliding_kv = next((kv[i] for i, t in enumerate(types) if t == SLIDING), kv[0])
        full_kv = next((kv[i] for i, t in enumerate(types) if t == FULL), sliding_kv)
        ff = get("feed_forward_length")
        ff = list(ff) if isinstance(ff, (list, tuple)) else [int(ff)] * n
        double = [ff[0] * (2 if sources[i] != i else 1) for i in range(n)]
        if ff != [ff[0]] * n and ff != double:
            raise ValueError(f"gemma4.feed_forward_length {ff}: the widths are neither one "
                             f"nor the KV-shared layers' double")
        ple = int(get("embedding_length_per_layer_input", 0) or 0)
        cfg = {"layer_types": list(types), "sliding_window": get("attention.sliding_window"),
               "head_dim": int(get("attention.key_length_swa", base["head_dim"])),
               "global_head_dim": int(get("attention.key_length", base["head_dim"])),
               "num_key_value_heads": int(sliding_kv), "attention_k_eq_v": k_eq_v,
               "num_kv_shared_layers": shared, "use_double_wide_mlp": ff != [ff[0]] * n,
               "intermediate_size": int(ff[0]), "hidden_size_per_layer_input": ple,
               "vocab_size_per_layer_input": base["vocab_size"],
               "rms_norm_eps": base["rms_norm_eps"],
               "max_position_embeddings": base["max_position_embeddings"],
               "tie_word_embeddings": base["tie_word_embeddings"],
               "attention_bias": base["attention_bias"],
               "final_logit_softcapping": get("final_logit_softcapping"),
               "rope_parameters": {
                   FULL: {"rope_type": "default", "rope_theta": base["rope_theta"]},
                   SLIDING: {"rope_type": "default",
                             "rope_theta": base.get("rope_local_theta", 10000.0)}}}
        if k_eq_v:
            cfg["num_global_key_value_heads"] = int(full_kv)
        if base.get("num_experts"):
            cfg.update(enable_moe_block=True, num_experts=base["num_experts"],
                       top_k_experts=base["num_experts_per_tok"],
                       moe_intermediate_size=base["moe_intermediate_size"])
        out = self.hf_config(cfg, base)
        out.update(rotary_dim=None, dense_layers=())
        return out

    def gguf_rope_freqs(self, cfg, factors):
        """rope_freqs: the global layers' proportional rotary, a factor a frequency of the
        global head (1: it turns; 1e30: it does not)."""
        full = next(i for i, t in enumerate(cfg.layer_types) if t == FULL)
        half = cfg.head_dim_of(full) // 2
        turn = sum(1 for f in factors if f == 1.0)
        if len(factors) != half or any(f != 1.0 and f < 1e20 for f in factors) \
                or list(factors) != [1.0] * turn + [factors[-1]] * (half - turn):
            raise ValueError(f"gemma4 rope_freqs ({len(factors)} factors) is not the global "
                             f"layers' proportional rotary over {half} frequencies")
        params = {"rope_type": "proportional", "partial_rotary_factor": turn / half,
                  "rope_theta": cfg.rope_theta}
        return dataclasses.replace(cfg, rope_scaling=rope_scaling(
            {"rope_parameters": {FULL: params},
             "max_position_embeddings": cfg.max_position_embeddings}))

    def gguf_name(self, gguf_name):
        if gguf_name in _GGUF_GLOBAL:
            return _GGUF_GLOBAL[gguf_name]
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scale)", gguf_name)
        if m and (m.group(2), m.group(3)) in _GGUF_LAYER:
            return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2), m.group(3)]}"
        return super().gguf_name(gguf_name)

    def from_gguf(self, hf_name, arr, cfg, rows_of):
        if hf_name == "model.embed_tokens_per_layer.weight":  # its rows past the vocabulary
            return arr[:cfg.vocab_size]
        return super().from_gguf(hf_name, arr, cfg, rows_of)

    # ---- names -------------------------------------------------------------------------------

    def internal_name(self, hf_name):
        # The multimodal checkpoint's text model: model.language_model.*, lm_head.
        name = hf_name.removeprefix("model.language_model.").removeprefix("model.")
        if name.startswith(_PLE):  # the per-layer inputs' model-level tensors
            return f"per_layer_embed.{name}"
        name = super().internal_name(name)
        return _MOE_RE.sub(lambda m: m.group(1) + _MOE_NAMES[m.group(2)], name)
