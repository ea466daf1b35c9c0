"""EXAONE 4: OLMo 2's post-norms (after attention and the MLP, none before) with q/k
RMSNorms per head, and where the config sets a window, sliding layers (three in four by
default) and global layers that attend without rotary (NoPE). GGUF: llama.cpp's `exaone4`,
its layer kinds in attention.sliding_window_pattern (a bool a layer, true where it slides,
or a period), llama3 rope scaling as its rope_freqs tensor."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import SLIDING, hf_layer_types, window_pattern


class Exaone4(Family):
    name = "exaone4"
    architectures = ("Exaone4ForCausalLM",)
    gguf_architectures = ("exaone4",)
    gguf_layer_names = {"post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
    renames = {"post_attention_layernorm": "attn_out_norm",
               "post_feedforward_layernorm": "mlp_out_norm"}

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if window and not types:
            types = window_pattern(cfg.get("sliding_window_pattern") or 4, n)
        return self._options(cfg, n, window, types)

    def gguf_config(self, get, base, tensor_names):
        n = base["num_layers"]
        window = get("attention.sliding_window")
        types = window_pattern(get("attention.sliding_window_pattern", 4), n) if window else ()
        return self._options({"max_position_embeddings": base["max_position_embeddings"],
                              "sliding_window": window}, n, window and int(window), types)

    @staticmethod
    def _options(cfg, n, window, types):
        types = tuple(types or ())
        stated = hf_layer_types({**cfg, "layer_types": list(types)}, n) if types else ()
        out = {"qk_norm": True, "sandwich_norms": True, "pre_norms": False,
               "layer_types": stated, "sliding_window": window if stated else None}
        if window:  # the global layers of a hybrid model attend without rotary
            out["no_rope_layers"] = tuple(i for i, t in enumerate(types) if t != SLIDING)
        return out

