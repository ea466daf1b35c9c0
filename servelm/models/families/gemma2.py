"""Gemma 2: Gemma 3's layer without q/k norms (sandwich norms, GeGLU, (1 + w) RMSNorms,
embeddings scaled by sqrt(hidden), query_pre_attn_scalar as the softmax scale), sliding and
global layers alternating on one rotary base, and soft-capped attention scores and logits."""

from __future__ import annotations

from servelm.models.families.gemma3 import Gemma3
from servelm.models.hf_keys import FULL, SLIDING, hf_layer_types


class Gemma2(Gemma3):
    name = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    gguf_architectures = ("gemma2",)

    def _caps(self, attn, final):
        return {"attn_logit_softcap": float(attn) if attn else None,
                "final_logit_softcap": float(final) if final else None}

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        types = hf_layer_types(cfg, n)
        if cfg.get("sliding_window") and not cfg.get("layer_types"):
            # transformers 4's configs: even layers (from 0) slide, odd ones are global.
            types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))
        return {**self._common(base, cfg.get("query_pre_attn_scalar") or base["head_dim"]),
                "qk_norm": False, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "layer_types": types,
                "sliding_window": cfg.get("sliding_window") if types else None,
                **self._caps(cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping"))}

    def gguf_config(self, get, base, tensor_names):
        # llama.cpp's gemma2: the window and both caps in the metadata, every other layer
        # sliding (from layer 0); the softmax scale is not stored: head_dim ** -0.5, but
        # (hidden / heads) ** -0.5 for the 27B (46 layers), as llama.cpp derives it.
        n = base["num_layers"]
        scalar = base["hidden_size"] // base["num_heads"] if n == 46 else base["head_dim"]
        window = get("attention.sliding_window")
        types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(n)) if window else ()
        return {**self._common(base, scalar), "qk_norm": False, "layer_types": types,
                "sliding_window": int(window) if window else None,
                **self._caps(get("attn_logit_softcapping"), get("final_logit_softcapping"))}
