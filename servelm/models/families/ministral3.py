"""Ministral 3 (text): Mistral's layer with YaRN and Llama 4's position-dependent query
scaling (queries times 1 + llama_4_scaling_beta * ln(1 + floor(position /
original_max_position_embeddings)), after the rotary)."""

from __future__ import annotations

from servelm.models.families.llama import Llama


class Ministral3(Llama):
    name = "ministral3"
    architectures = ("Ministral3ForCausalLM",)
    # llama.cpp's mistral3: q/k rows permuted as for llama; YaRN's mscale_all_dim in
    # rope.scaling.yarn_log_multiplier (mscale read as equal to it, as the configs have them),
    # llama_4_scaling_beta in attention.temperature_scale.
    gguf_architectures = ("mistral3",)
    gguf_permute_qk = True

    def gguf_config(self, get, base, tensor_names):
        out = super().gguf_config(get, base, tensor_names)
        scaling = base["rope_scaling"]
        if scaling and scaling["rope_type"] == "yarn":
            m = float(get("rope.scaling.yarn_log_multiplier", 1.0))
            out["rope_scaling"] = {**scaling,
                                   "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                                   "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
                                   "mscale": m, "mscale_all_dim": m}
        beta = get("attention.temperature_scale")
        if beta:
            period = scaling and scaling.get("original_max_position_embeddings")
            if not period:
                raise ValueError("attention.temperature_scale needs "
                                 "rope.scaling.original_context_length")
            out.update(query_scale_beta=float(beta), query_scale_period=int(period))
        return out

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
