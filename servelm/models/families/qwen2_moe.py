"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with top-k
routed experts and beside them a shared expert on every token, its output gated by
sigmoid(shared_expert_gate(x)); MoE on every decoder_sparse_step-th layer outside
mlp_only_layers, dense MLPs elsewhere."""

from __future__ import annotations

from servelm.models.families.qwen2 import _qwen_moe, _qwen_windows
from servelm.models.family import Family


# llama.cpp's names for a gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE).
SHARED_EXPERT_GGUF_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                            "ffn_up_shexp": "mlp.shared_expert.up_proj",
                            "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def shared_expert_gate_row(hf_name: str, arr):
    """The shared expert's gate as the [1, hidden] weight the model holds: llama.cpp keeps
    it as a vector. None for any other tensor."""
    if hf_name.endswith("shared_expert_gate.weight") and arr.ndim == 1:
        return arr.reshape(1, -1)
    return None


class Qwen2Moe(Family):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    gguf_architectures = ("qwen2moe",)
    gguf_layer_names = SHARED_EXPERT_GGUF_NAMES

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        return {"attention_bias": bool(cfg.get("qkv_bias", True)),
                **_qwen_windows(cfg, n), **_qwen_moe(cfg, n, norm_topk_prob=False)}

    def gguf_config(self, get, base, tensor_names):
        # llama.cpp's qwen2moe does not renormalise the chosen experts' weights.
        return {"shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0)),
                "norm_topk_prob": False}

    def from_gguf(self, hf_name, arr, cfg, rows_of):
        gate = shared_expert_gate_row(hf_name, arr)
        return gate if gate is not None else super().from_gguf(hf_name, arr, cfg, rows_of)
