"""Gemma 3 (text): interleaved sliding and global layers with their own rotary bases, q/k
norms, sandwich norms, GELU-tanh, embeddings scaled by sqrt(hidden), (1 + w) RMSNorms."""

from __future__ import annotations

from servelm.models.hf_keys import SLIDING, hf_layer_types, rope_theta, window_pattern
from servelm.models.family import Family


class Gemma3(Family):
    name = "gemma3"
    architectures = ("Gemma3ForCausalLM", "Gemma3TextModel")
    gguf_architectures = ("gemma3",)
    # The checkpoint's post_attention_layernorm comes after attention (a sandwich norm); the
    # decoder's post_attention_layernorm is the one before the MLP.
    renames = {"post_attention_layernorm": "attn_out_norm",
               "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "mlp_out_norm"}
    gguf_layer_names = {"post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
    norm_offset = 1.0

    def _common(self, base, scalar):
        return {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
                "embed_scale": base["hidden_size"] ** 0.5, "attn_scale": scalar ** -0.5,
                "tie_word_embeddings": base.get("tie_word_embeddings", True)}

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        types = hf_layer_types(cfg, n)
        if cfg.get("sliding_window") and not cfg.get("layer_types"):
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            types = window_pattern(pattern, n)
        local = rope_theta(cfg, SLIDING) if "rope_parameters" in cfg else None
        return {**self._common(base, cfg.get("query_pre_attn_scalar") or base["head_dim"]),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "layer_types": types, "sliding_window": cfg.get("sliding_window"),
                "rope_local_theta": local or cfg.get("rope_local_base_freq", 10000.0),
                "final_logit_softcap": cfg.get("final_logit_softcapping")}

    def gguf_config(self, get, base, tensor_names):
        # The file carries the window, not the pattern: Gemma 3's own (every 6th layer global,
        # as llama.cpp and transformers read it); the sliding layers' base where the converter
        # wrote it (base: rope.freq_base_swa), else Gemma 3's 10000.
        n = base["num_layers"]
        window = get("attention.sliding_window")
        types = window_pattern(6, n) if window else ()
        return {**self._common(base, base["head_dim"]), "layer_types": types,
                "sliding_window": int(window) if window else None,
                "rope_local_theta": base.get("rope_local_theta", 10000.0)}
