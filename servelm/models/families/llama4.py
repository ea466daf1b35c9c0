"""Llama 4 (text): Llama's layer with

- chunked local attention on the rotary layers (attention_chunk_size: a query attends only
  the keys of its own chunk, floor(position / chunk) equal; Attention.chunk, which every
  attention backend runs),
- no rotary on every no_rope_layer_interval-th layer (no_rope_layers: 1 rotary, 0 none),
  those layers attending to everything with their queries scaled by the attention
  temperature (attn_temperature_tuning: log1p(floor((position + 1) / floor_scale)) *
  attn_scale + 1),
- a weightless RMS norm of each head's q and k after the rotary on the rotary layers
  (use_qk_norm; transformers' Llama4TextL2Norm),
- the rotary over adjacent pairs of dims (q/k rows reordered at load), llama3 scaling,
- MoE layers (moe_layers, or every interleave_moe_layer_step-th) among dense ones: the
  dense MLP intermediate_size_mlp wide, the experts and the shared expert intermediate_size;
  the router's top k logits through a sigmoid (not renormalised) weight the chosen experts'
  INPUTS, and the shared expert's output is added ungated.

The HF checkpoint holds each layer's experts in one tensor a projection, gate_up_proj
[E, hidden, 2I] (gate columns, then up) and down_proj [E, I, hidden]; the multimodal
Llama4ForConditionalGeneration keeps the text model's config in text_config and its
tensors under language_model. (the vision tower's are not read). llama.cpp's `llama4` has
separate gate / up / down experts, the shared expert as *_shexp, and no metadata for the
chunk, the temperature or the no-rope layers: its loader hard-codes them (chunks of 8192,
every 4th layer without rotary, floor 8192, scale 0.1; q/k norms unless 128 experts), and
an attention.sliding_window of 0 turns chunks and no-rope layers off."""

from __future__ import annotations

from servelm.models.family import Family

CHUNKED = "chunked_attention"
# llama.cpp's built-in values for its `llama4` architecture (llama-model.cpp).
GGUF_CHUNK, GGUF_NO_ROPE_STEP, GGUF_FLOOR_SCALE, GGUF_ATTN_SCALE = 8192, 4, 8192, 0.1
# Maverick's expert count: llama.cpp runs its layers without the q/k norm.
GGUF_NO_QK_NORM_EXPERTS = 128


def _options(n: int, no_rope: tuple[int, ...], chunked: tuple[int, ...], chunk: int | None,
             qk_norm: bool, temperature: tuple[int, float] | None) -> dict:
    """The ModelConfig fields and extra options of a Llama 4 text model of n layers."""
    rope = tuple(i for i in range(n) if i not in no_rope)
    extra = {"router_scoring": "sigmoid", "expert_input_weighted": True,
             "shared_expert_gate": False,
             "qk_l2_norm_layers": rope if qk_norm else ()}
    if chunked:
        extra.update(attention_chunk_size=int(chunk), chunked_layers=chunked)
    out = {"no_rope_layers": no_rope, "rope_interleaved": True, "norm_topk_prob": False,
           "extra": extra}
    if temperature and no_rope:
        floor_scale, attn_scale = temperature
        out.update(query_scale_beta=float(attn_scale), query_scale_period=int(floor_scale))
        extra.update(query_scale_layers=no_rope, query_scale_offset=1.0)
    return out


class Llama4(Family):
    name = "llama4"
    architectures = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
    gguf_architectures = ("llama4",)
    renames = {"feed_forward": "mlp", "router": "gate"}
    gguf_layer_names = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                        "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj"}

    # ---- the multimodal checkpoint's text model (read by the loader) -------------------------

    @staticmethod
    def hf_ignored(key: str) -> bool:
        """A multimodal checkpoint's tensors outside the language model (the vision tower,
        the projector), which the text model does not read."""
        return key.startswith(("vision_model.", "multi_modal_projector."))

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        flags = cfg.get("no_rope_layers")
        if not flags:  # transformers' default: every interval-th layer without rotary
            every = cfg.get("no_rope_layer_interval") or 4
            flags = [int((i + 1) % every != 0) for i in range(n)]
        if len(flags) != n:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
        no_rope = tuple(i for i, f in enumerate(flags) if not f)
        chunk = cfg.get("attention_chunk_size")
        types = cfg.get("layer_types") or [CHUNKED if f and chunk else "full_attention"
                                           for f in flags]
        bad = set(types) - {CHUNKED, "full_attention"}
        if bad:
            raise ValueError(f"unsupported Llama 4 layer types {sorted(bad)}")
        chunked = tuple(i for i, t in enumerate(types) if t == CHUNKED) if chunk else ()
        moe = cfg.get("moe_layers")
        if moe is None:
            step = cfg.get("interleave_moe_layer_step") or 1
            moe = range(step - 1, n, step)
        moe = set(moe)
        experts = cfg.get("num_local_experts") or 0
        temperature = ((cfg.get("floor_scale", 8192), cfg.get("attn_scale", 0.1))
                       if cfg.get("attn_temperature_tuning", True) else None)
        return {"intermediate_size": cfg.get("intermediate_size_mlp") or cfg["intermediate_size"],
                "num_experts": experts if moe else 0,
                "num_experts_per_tok": cfg.get("num_experts_per_tok", 1) if moe else 0,
                "moe_intermediate_size": cfg["intermediate_size"],
                "shared_expert_intermediate_size": cfg["intermediate_size"],
                "dense_layers": tuple(i for i in range(n) if i not in moe),
                **_options(n, no_rope, chunked, chunk, bool(cfg.get("use_qk_norm", True)),
                           temperature)}

    def gguf_config(self, get, base, tensor_names):
        n = base["num_layers"]
        window = get("attention.sliding_window")
        if window is not None and int(window) == 0:  # chunks and no-rope layers off
            no_rope, chunked = (), ()
        else:
            no_rope = tuple(i for i in range(n) if (i + 1) % GGUF_NO_ROPE_STEP == 0)
            chunked = tuple(i for i in range(n) if i not in no_rope)
        experts = base.get("num_experts", 0)
        return {"shared_expert_intermediate_size": base.get("moe_intermediate_size", 0),
                **_options(n, no_rope, chunked, GGUF_CHUNK,
                           experts != GGUF_NO_QK_NORM_EXPERTS,
                           (GGUF_FLOOR_SCALE, GGUF_ATTN_SCALE))}

    # ---- names and values -----------------------------------------------------------------

    def internal_name(self, hf_name):
        # The multimodal checkpoint's text model: language_model.model.*, language_model.lm_head.
        return super().internal_name(hf_name.removeprefix("language_model."))

    def transform(self, name, tensor):
        # HF's experts -> SparseMoE's [E, 2I, hidden] (gate rows, then up) and [E, hidden, I].
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return tensor.transpose(1, 2)
        return super().transform(name, tensor)
