"""Qwen2 / Qwen2.5: q/k/v biases (always, as transformers builds them), untied head."""

from __future__ import annotations

from servelm.models.hf_keys import FULL, SLIDING
from servelm.models.family import Family


class Qwen2(Family):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    gguf_architectures = ("qwen2",)

    def hf_config(self, cfg, base):
        # transformers gives Qwen2 a q/k/v bias whatever the config says (it has no key).
        return {"attention_bias": True, **_qwen_windows(cfg, base["num_layers"])}


def _qwen_moe(cfg, num_layers, norm_topk_prob: bool) -> dict:
    """The MoE keys Qwen's MoE families share (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE):
    top-k of num_experts, a shared expert where shared_expert_intermediate_size says,
    norm_topk_prob (the family's default when the config is silent), MoE on every
    decoder_sparse_step-th layer outside mlp_only_layers."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or ())
    return {"num_experts": cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", norm_topk_prob)),
            "dense_layers": tuple(i for i in range(num_layers) if i in only or (i + 1) % step)}


def _qwen_windows(cfg, num_layers):
    """Qwen's sliding window: on layers from max_window_layers when use_sliding_window."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return {}
    types = cfg.get("layer_types") or [
        SLIDING if i >= cfg.get("max_window_layers", num_layers) else FULL
        for i in range(num_layers)]
    return {"sliding_window": cfg["sliding_window"], "layer_types": tuple(types)}
