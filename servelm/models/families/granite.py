"""Granite (3.x dense): Llama's layer with four multipliers: embeddings times
embedding_multiplier, the softmax scale attention_multiplier, each attention and MLP output
times residual_multiplier before it joins the residual stream, logits divided by
logits_scaling."""

from __future__ import annotations

from servelm.models.families.llama import Llama


class Granite(Llama):
    name = "granite"
    architectures = ("GraniteForCausalLM",)
    gguf_architectures = ("granite",)

    def hf_config(self, cfg, base):
        if cfg.get("mlp_bias"):
            raise ValueError("Granite with mlp_bias is not supported")
        return {**super().hf_config(cfg, base),
                "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
                "attn_scale": float(cfg.get("attention_multiplier", 1.0)),
                "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
                "logits_scaling": float(cfg.get("logits_scaling", 1.0))}

    def gguf_config(self, get, base, tensor_names):
        # llama.cpp's names for them; a missing one is llama.cpp's default (no scaling, and
        # the usual head_dim ** -0.5 softmax scale).
        scale = get("attention.scale")
        return {"embed_scale": float(get("embedding_scale", 1.0)),
                "attn_scale": float(scale) if scale else None,
                "residual_scale": float(get("residual_scale", 1.0)),
                "logits_scaling": float(get("logit_scale", 1.0))}
