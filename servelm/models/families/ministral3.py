"""Ministral 3 (text): Mistral's layer with YaRN and Llama 4's position-dependent query
scaling (queries times 1 + llama_4_scaling_beta * ln(1 + floor(position /
original_max_position_embeddings)), after the rotary)."""

from __future__ import annotations

from servelm.models.families.llama import Llama


class Ministral3(Llama):
    name = "ministral3"
    architectures = ("Ministral3ForCausalLM",)
    gguf_architectures = ()  # llama.cpp's mistral3 spelling is not read here yet
    gguf_permute_qk = False

    def hf_config(self, cfg, base):
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        out = super().hf_config(cfg, base)
        beta = params.get("llama_4_scaling_beta")
        if beta:
            period = params.get("original_max_position_embeddings")
            if not period:
                raise ValueError("llama_4_scaling_beta needs original_max_position_embeddings")
            out.update(query_scale_beta=float(beta), query_scale_period=int(period))
        return out
