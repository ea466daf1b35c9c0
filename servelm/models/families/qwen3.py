"""Qwen3 (q/k RMSNorm per head, no bias) and Qwen3-MoE (top-k routed experts)."""

from __future__ import annotations

from servelm.models.families.qwen2 import _qwen_moe, _qwen_windows
from servelm.models.family import Family


class Qwen3(Family):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    gguf_architectures = ("qwen3",)

    def hf_config(self, cfg, base):
        return {"qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False)),
                **_qwen_windows(cfg, base["num_layers"])}

    def gguf_config(self, get, base, tensor_names):
        return {"qk_norm": True}


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    gguf_architectures = ("qwen3moe",)

    def hf_config(self, cfg, base):
        return {**super().hf_config(cfg, base),
                **_qwen_moe(cfg, base["num_layers"], norm_topk_prob=False)}

    def gguf_config(self, get, base, tensor_names):
        # llama.cpp always renormalises Qwen3-MoE's top-k weights (transformers' GGUF
        # loader sets norm_topk_prob for it too).
        return {"qk_norm": True, "norm_topk_prob": True}
