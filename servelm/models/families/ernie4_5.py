"""ERNIE 4.5 (dense): Llama's layer with a pairwise (GPT-J style) rotary over each whole
head, which the decoder reorders at load to its rotate-half layout
(ModelConfig.rope_interleaved); embeddings tied by default."""

from __future__ import annotations

from servelm.models.families.llama import Llama


class Ernie4_5(Llama):
    name = "ernie4_5"
    architectures = ("Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM")
    gguf_architectures = ("ernie4_5",)
    gguf_permute_qk = False  # llama.cpp's converter keeps the checkpoint's rows

    def hf_config(self, cfg, base):
        if cfg.get("use_bias"):
            raise ValueError("ERNIE 4.5 with use_bias is not supported")
        return {**super().hf_config(cfg, base), "rope_interleaved": True,
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}

    def gguf_config(self, get, base, tensor_names):
        return {"rope_interleaved": True}
