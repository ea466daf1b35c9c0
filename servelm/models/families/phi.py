"""Phi-1 / 1.5 / 2 (PhiForCausalLM): attention and MLP in parallel on one LayerNorm (with
a bias), biases on every linear layer and on the LM head, a non-gated tanh-GELU MLP (fc1,
fc2), a partial rotary (half of each head by default)."""

from __future__ import annotations

import re

from servelm.models.families.stablelm import partial_rotary
from servelm.models.family import Family


class Phi(Family):
    name = "phi"
    architectures = ("PhiForCausalLM",)
    gguf_architectures = ("phi2",)
    renames = {"dense": "o_proj"}
    gguf_layer_names = {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
                        "attn_output": "self_attn.dense"}

    def _common(self):
        return {"norm_type": "layer", "parallel_block": True, "mlp_gated": False,
                "mlp_bias": True, "hidden_act": "gelu_tanh", "attention_bias": True,
                "attention_out_bias": True, "lm_head_bias": True}

    def hf_config(self, cfg, base):
        if cfg.get("qk_layernorm"):
            raise ValueError("Phi with qk_layernorm is not supported")
        if cfg.get("hidden_act", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"Phi with hidden_act {cfg['hidden_act']!r} is not supported")
        return {**self._common(), "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
                **partial_rotary(cfg, base["head_dim"], 0.5)}

    def gguf_config(self, get, base, tensor_names):
        return {**self._common(), "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}

    def internal_name(self, hf_name):
        # fc1 / fc2: the decoder's MLP spells them c_fc / c_proj; final_layernorm is its norm.
        name = re.sub(r"\.mlp\.fc([12])\.", lambda m: ".mlp.c_fc." if m.group(1) == "1"
                      else ".mlp.c_proj.", super().internal_name(hf_name))
        return re.sub(r"^final_layernorm\.", "norm.", name)
