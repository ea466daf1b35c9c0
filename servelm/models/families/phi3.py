"""Phi-3 / Phi-3.5 / Phi-4-mini: checkpoints hold fused qkv and gate_up tensors (the
decoder's own layout; tensor parallelism reads each rank's rows of every part), and a
partial rotary where partial_rotary_factor < 1."""

from __future__ import annotations

from servelm.models.hf_keys import hf_layer_types
from servelm.models.family import Family


class Phi3(Family):
    name = "phi3"
    architectures = ("Phi3ForCausalLM",)
    gguf_architectures = ("phi3",)
    gguf_layer_names = {"ffn_up": "mlp.gate_up_proj"}  # llama.cpp keeps gate and up fused

    def hf_config(self, cfg, base):
        params = cfg.get("rope_parameters") or {}
        factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
        out = {"layer_types": hf_layer_types(cfg, base["num_layers"]),
               "sliding_window": cfg.get("sliding_window")}
        if factor < 1.0:
            out["rotary_dim"] = int(base["head_dim"] * factor)
        return out
