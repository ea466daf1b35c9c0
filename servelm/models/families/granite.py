"""Granite (3.x dense): Llama's layer with four multipliers: embeddings times
embedding_multiplier, the softmax scale attention_multiplier, each attention and MLP output
times residual_multiplier before it joins the residual stream, logits divided by
logits_scaling."""

from __future__ import annotations

import re

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


class GraniteMoe(Granite):
    """Granite 3.x MoE: Granite's multipliers, every MLP top-k routed experts (the router
    softmaxes the chosen experts' logits: the renormalised top-k of a softmax)."""

    name = "granitemoe"
    architectures = ("GraniteMoeForCausalLM",)
    gguf_architectures = ("granitemoe",)

    def hf_config(self, cfg, base):
        return {**super().hf_config(cfg, base), "num_experts": cfg["num_local_experts"],
                "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}

    def gguf_config(self, get, base, tensor_names):
        return {**super().gguf_config(get, base, tensor_names), "norm_topk_prob": True}

    def internal_name(self, hf_name):
        # Its checkpoints' experts in one tensor each (input_linear: gate then up rows) and
        # router.layer, or transformers 5's names for them.
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"\.mlp\.router(\.layer)?\.weight$", ".mlp.gate.weight", name)
        name = re.sub(r"\.mlp\.input_linear\.weight$", ".mlp.experts.gate_up_proj", name)
        return re.sub(r"\.mlp\.output_linear\.weight$", ".mlp.experts.down_proj", name)
