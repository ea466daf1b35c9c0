"""gpt-oss (OpenAI's open-weight MoE): attention with q/k/v and o_proj biases and a learned
sink logit per head in each query's softmax denominator (attention sinks, which every
attention backend runs), sliding-window and full layers alternating (even layers
slide), YaRN rotary (not truncated), and on every layer routed experts: a router with a
bias, experts with biases and gpt-oss's clamped SwiGLU. The HF checkpoint holds each
layer's experts in one tensor a projection, [E, hidden, 2 * I] with gate and up columns
interleaved and [E, I, hidden] (transposed from servelm's), as dense values or as MXFP4
blocks and scales (kept as MXFP4 by default: SparseMoE.to_mxfp4); llama.cpp's `gpt-oss` has
separate gate / up / down tensors (MXFP4) with biases, the sinks as attn_sinks."""

from __future__ import annotations

import re

import numpy as np
import torch

from servelm.models.family import Family
from servelm.models.hf_keys import FULL, SLIDING, hf_layer_types

# The clamped SwiGLU's limit and sigmoid gain: transformers' GptOssConfig defaults (which
# older config.json files leave out), llama.cpp's constants.
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702

# llama.cpp's layer tensors that GGUF_LAYER_NAMES does not name (HF spelling, no suffix
# added): the sinks, and the gate and up experts fused by --fuse-gate-up-exps (gate rows,
# then up rows).
_GGUF_OWN = {"attn_sinks.weight": "self_attn.sinks",
             "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
             "ffn_gate_up_exps.bias": "mlp.experts.gate_up_proj_bias"}


def _alternating(n: int) -> tuple[str, ...]:
    """gpt-oss's default layer kinds (and llama.cpp's for it): even layers slide."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Gate / up interleaved along dim 1 (gate 0, up 0, gate 1, ...) -> the gates, then the ups."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOss(Family):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    gguf_architectures = ("gpt-oss",)
    renames = {"router": "gate"}  # mlp.router.{weight,bias}: SparseMoE's gate
    gguf_layer_names = {"post_attention_norm": "post_attention_layernorm"}
    # Tensor parallelism: HF's experts [E, hidden, 2 I] (gate and up interleaved: a rank's
    # slice of the intermediate size is a run of column pairs) and [E, I, hidden]; llama.cpp's
    # follow the shared rules.
    hf_shard_rules = (
        (r"\.mlp\.experts\.gate_up_proj$", 2, "moe_intermediate", "pair"),
        (r"\.mlp\.experts\.gate_up_proj_bias$", 1, "moe_intermediate", "pair"),
        (r"\.mlp\.experts\.down_proj$", 1, "moe_intermediate", "one"),
    )

    @staticmethod
    def _extra(limit: float, alpha: float) -> dict:
        return {"extra": {"attention_sinks": True, "router_bias": True, "expert_bias": True,
                          "swiglu_limit": float(limit), "swiglu_alpha": float(alpha)}}

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        types = hf_layer_types(cfg, n)
        if cfg.get("sliding_window") and not cfg.get("layer_types"):
            types = _alternating(n)
        bias = bool(cfg.get("attention_bias", True))
        return {"attention_bias": bias, "attention_out_bias": bias,
                "num_experts": cfg["num_local_experts"],
                "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"],
                # top-k logits then a softmax over them: the softmax over all, renormalised
                "norm_topk_prob": True,
                "layer_types": types,
                "sliding_window": cfg.get("sliding_window") if types else None,
                **self._extra(cfg.get("swiglu_limit") or SWIGLU_LIMIT,
                              cfg.get("swiglu_alpha") or SWIGLU_ALPHA)}

    def gguf_config(self, get, base, tensor_names):
        window = get("attention.sliding_window")
        scaling = base["rope_scaling"]
        if scaling and scaling["rope_type"] == "yarn":
            # gpt-oss's YaRN ramp is not truncated to whole dims (its HF config's
            # truncate: false); llama.cpp stores neither that nor the betas (32, 1).
            scaling = {**scaling, "truncate": False, "beta_fast": 32.0, "beta_slow": 1.0}
        return {"attention_out_bias": "blk.0.attn_output.bias" in tensor_names,
                "norm_topk_prob": True, "rope_scaling": scaling,
                "layer_types": _alternating(base["num_layers"]) if window else (),
                "sliding_window": int(window) if window else None,
                **self._extra(SWIGLU_LIMIT, SWIGLU_ALPHA)}

    # ---- names and values -----------------------------------------------------------------

    def gguf_name(self, gguf_name):
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m and m.group(2) in _GGUF_OWN:
            return f"model.layers.{m.group(1)}.{_GGUF_OWN[m.group(2)]}"
        return super().gguf_name(gguf_name)

    def from_gguf(self, hf_name, arr, cfg, rows_of):
        # llama.cpp's fused gate / up experts (gate rows, then up) in HF's interleaved
        # convention, which transform() then undoes like the HF checkpoint's.
        if hf_name.endswith(".experts.gate_up_proj"):       # [E, 2I, H] -> [E, H, 2I]
            e, two_i, h = arr.shape
            gate, up = arr[:, :two_i // 2], arr[:, two_i // 2:]
            return np.stack((gate, up), axis=2).reshape(e, two_i, h).transpose(0, 2, 1)
        if hf_name.endswith(".experts.gate_up_proj_bias"):  # [E, 2I]
            e, two_i = arr.shape
            return np.stack((arr[:, :two_i // 2], arr[:, two_i // 2:]), axis=2).reshape(e, two_i)
        return super().from_gguf(hf_name, arr, cfg, rows_of)

    def internal_name(self, hf_name):
        name = super().internal_name(hf_name)
        # The experts' biases, one tensor a projection: SparseMoE's parameters.
        return (name.replace(".experts.gate_up_proj_bias", ".experts_gate_up_bias")
                .replace(".experts.down_proj_bias", ".experts_down_bias"))

    def transform_mxfp4(self, name, w):
        # HF's gate_up blocks have the dense form's interleaved rows (gate 0, up 0, ...);
        # llama.cpp's are gate rows, then up.
        if w.source == "hf" and name.endswith(".experts.gate_up_proj"):
            n = w.shape[1]
            return w.rows(torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))))
        return w

    def transform(self, name, tensor):
        # HF's experts -> SparseMoE's [E, 2I, hidden] (gate rows, then up) and [E, hidden, I].
        if name.endswith(".experts.gate_up_proj"):
            return _deinterleave(tensor.transpose(1, 2))
        if name.endswith(".experts.down_proj"):
            return tensor.transpose(1, 2)
        if name.endswith(".experts_gate_up_bias"):
            return _deinterleave(tensor)
        return super().transform(name, tensor)
