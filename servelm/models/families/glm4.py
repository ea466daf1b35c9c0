"""GLM-4 (Glm4ForCausalLM, GLM-4-0414): sandwich norms (a norm on the attention and on the
MLP output, besides the usual two before them), q/k/v biases, a fused gate_up checkpoint
tensor, and a partial rotary (half of each head by default) over adjacent pairs of dims,
which the decoder reorders at load to its rotate-half layout (ModelConfig.rope_interleaved)."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import hf_layer_types


class Glm4(Family):
    name = "glm4"
    architectures = ("Glm4ForCausalLM",)
    gguf_architectures = ("glm4",)
    # The checkpoint's post_attention_layernorm is the one before the MLP, as the decoder's.
    renames = {"post_self_attn_layernorm": "attn_out_norm",
               "post_mlp_layernorm": "mlp_out_norm"}
    gguf_layer_names = {"ffn_up": "mlp.gate_up_proj",  # llama.cpp keeps gate and up fused
                        "post_attention_norm": "post_self_attn_layernorm",
                        "post_ffw_norm": "post_mlp_layernorm"}

    def hf_config(self, cfg, base):
        params = cfg.get("rope_parameters") or {}
        factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.5
        out = {"sandwich_norms": True, "rope_interleaved": True,
               "attention_bias": bool(cfg.get("attention_bias", True)),
               "layer_types": hf_layer_types(cfg, base["num_layers"]),
               "sliding_window": cfg.get("sliding_window")}
        if factor < 1.0:
            out["rotary_dim"] = int(base["head_dim"] * factor)
        return out

    def gguf_config(self, get, base, tensor_names):
        # rope.dimension_count (the partial rotary) is read with the common keys.
        return {"sandwich_norms": True, "rope_interleaved": True}
