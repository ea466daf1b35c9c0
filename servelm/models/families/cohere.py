"""Cohere (Command R, Aya 23: CohereForCausalLM): attention and MLP in parallel on one
LayerNorm without a bias, a pairwise (GPT-J style) rotary over each head (q/k rows
reordered at load, ModelConfig.rope_interleaved), logits multiplied by logit_scale (held
as its divisor, logits_scaling), embeddings tied. Per-head q/k LayerNorms (use_qk_norm,
Command R+) are not supported."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import hf_layer_types


class Cohere(Family):
    name = "cohere"
    architectures = ("CohereForCausalLM",)
    gguf_architectures = ("command-r",)

    def _common(self, bias, logit_scale):
        return {"norm_type": "layer_no_bias", "parallel_block": True, "rope_interleaved": True,
                "attention_bias": bias, "attention_out_bias": bias,
                "logits_scaling": 1.0 / float(logit_scale)}

    def hf_config(self, cfg, base):
        if cfg.get("use_qk_norm"):
            raise ValueError("Cohere with use_qk_norm (Command R+) is not supported")
        return {**self._common(bool(cfg.get("attention_bias", False)),
                               cfg.get("logit_scale", 0.0625)),
                "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window")}

    def gguf_config(self, get, base, tensor_names):
        return {**self._common("blk.0.attn_q.bias" in tensor_names, get("logit_scale", 1.0)),
                "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}
