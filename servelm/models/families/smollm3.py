"""SmolLM3: Llama's layer, with every no_rope_layer_interval-th layer (4th) attending
without rotary (NoPE); where use_sliding_window is on, transformers makes those NoPE layers
the sliding ones (its layer_types)."""

from __future__ import annotations

from servelm.models.families.llama import Llama


class SmolLM3(Llama):
    name = "smollm3"
    architectures = ("SmolLM3ForCausalLM",)
    gguf_architectures = ("smollm3",)

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        # no_rope_layers: per layer 1 (rotary) or 0 (none); else every interval-th has none.
        flags = cfg.get("no_rope_layers")
        if flags is None:
            every = cfg.get("no_rope_layer_interval") or 4
            flags = [int((i + 1) % every != 0) for i in range(n)]
        if len(flags) != n:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
        return {**super().hf_config(cfg, base),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "attention_bias": bool(cfg.get("attention_bias", False)),
                "no_rope_layers": tuple(i for i, f in enumerate(flags) if not f)}

    def gguf_config(self, get, base, tensor_names):
        # llama.cpp's smollm3 stores no pattern: every 4th layer without rotary, as its
        # loader hard-codes.
        return {"no_rope_layers": tuple(i for i in range(base["num_layers"]) if (i + 1) % 4 == 0)}
