"""EXAONE 4: OLMo 2's post-norms (after attention and the MLP, none before) with q/k
RMSNorms per head, and where the config sets a window, sliding layers (three in four by
default) and global layers that attend without rotary (NoPE)."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import FULL, SLIDING, hf_layer_types


class Exaone4(Family):
    name = "exaone4"
    architectures = ("Exaone4ForCausalLM",)
    gguf_architectures = ()  # llama.cpp's exaone4 spelling is not read here yet
    renames = {"post_attention_layernorm": "attn_out_norm",
               "post_feedforward_layernorm": "mlp_out_norm"}

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if window and not types:
            pattern = cfg.get("sliding_window_pattern") or 4
            if isinstance(pattern, str):  # e.g. "LLLG", repeating from layer 0
                types = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
            else:
                types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        types = tuple(types or ())
        stated = hf_layer_types({**cfg, "layer_types": list(types)}, n) if types else ()
        out = {"qk_norm": True, "sandwich_norms": True, "pre_norms": False,
               "layer_types": stated, "sliding_window": window if stated else None}
        if window:  # the global layers of a hybrid model attend without rotary
            out["no_rope_layers"] = tuple(i for i, t in enumerate(types) if t != SLIDING)
        return out
