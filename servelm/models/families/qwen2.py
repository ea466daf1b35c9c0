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


def _qwen_windows(cfg, num_layers):
    """Qwen's sliding window: on layers from max_window_layers when use_sliding_window."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return {}
    types = cfg.get("layer_types") or [
        SLIDING if i >= cfg.get("max_window_layers", num_layers) else FULL
        for i in range(num_layers)]
    return {"sliding_window": cfg["sliding_window"], "layer_types": tuple(types)}
