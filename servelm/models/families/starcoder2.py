"""Starcoder2: LayerNorms with biases, biases on every attention and MLP linear layer, a
non-gated tanh-GELU MLP (c_fc, c_proj), a sliding window on every layer where the config
sets one."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import SLIDING, hf_layer_types

_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class Starcoder2(Family):
    name = "starcoder2"
    architectures = ("Starcoder2ForCausalLM",)
    gguf_architectures = ("starcoder2",)
    gguf_layer_names = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}

    def _common(self, bias):
        return {"norm_type": "layer", "mlp_gated": False, "hidden_act": "gelu_tanh",
                "attention_bias": bias, "attention_out_bias": bias, "mlp_bias": bias}

    def hf_config(self, cfg, base):
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"Starcoder2 with hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(_ACTS)})")
        return {**self._common(bool(cfg.get("use_bias", True))),
                "rms_norm_eps": float(cfg.get("norm_epsilon", 1e-5)),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window")}

    def gguf_config(self, get, base, tensor_names):
        out = {**self._common("blk.0.attn_q.bias" in tensor_names),
               "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}
        window = get("attention.sliding_window")
        if window:  # every layer, as the HF config's
            out.update(sliding_window=int(window), layer_types=(SLIDING,) * base["num_layers"])
        return out
