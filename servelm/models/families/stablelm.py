"""StableLM (2, Zephyr, 3B-4E1T): LayerNorms with biases, a partial rotary (a quarter of
each head by default), optional q/k/v biases, and where use_parallel_residual says, the
attention and MLP in parallel on one norm. Per-head q/k LayerNorms (qk_layernorm) are
not supported."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import hf_layer_types


def partial_rotary(cfg, head_dim: int, default: float) -> dict:
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or default
    return {"rotary_dim": int(head_dim * factor)} if factor < 1.0 else {}


class StableLm(Family):
    name = "stablelm"
    architectures = ("StableLmForCausalLM",)
    gguf_architectures = ("stablelm",)

    def hf_config(self, cfg, base):
        if cfg.get("qk_layernorm"):
            raise ValueError("StableLM with qk_layernorm is not supported")
        parallel = bool(cfg.get("use_parallel_residual", False))
        return {"norm_type": "layer", "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
                "attention_bias": bool(cfg.get("use_qkv_bias", False)),
                "parallel_block": parallel,
                "layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window"),
                **partial_rotary(cfg, base["head_dim"], 0.25)}

    def gguf_config(self, get, base, tensor_names):
        # No post-attention norm tensors: the parallel form. rope.dimension_count is read
        # with the common keys.
        return {"norm_type": "layer",
                "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
                "parallel_block": "blk.0.ffn_norm.weight" not in tensor_names}
