"""Mixtral: Mistral's attention with top-k routed experts (weights always renormalised)."""

from __future__ import annotations

from servelm.models.hf_keys import hf_layer_types
from servelm.models.family import Family


class Mixtral(Family):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    renames = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    gguf_permute_qk = True  # its GGUF form is llama.cpp's `llama` with experts

    def hf_config(self, cfg, base):
        return {"num_experts": cfg["num_local_experts"],
                "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"],
                "norm_topk_prob": True,
                "layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window")}
