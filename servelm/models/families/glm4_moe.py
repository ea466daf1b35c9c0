"""GLM-4-MoE (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama's pre-norm layer
with q/k/v biases (attention_bias), optional per-head q/k norms (use_qk_norm) and a partial
rotary (partial_rotary_factor, half of each head by default, rotate-half), then dense MLPs on
the first first_k_dense_replace layers and MoE layers after them: n_routed_experts of
moe_intermediate_size behind DeepSeek-V3's router (sigmoid scores, the choice biased by
e_score_correction_bias among the topk_group best of n_group groups, the chosen scores
renormalised with norm_topk_prob, times routed_scaling_factor) and n_shared_experts shared
experts on every token, ungated (one MLP of n_shared_experts * moe_intermediate_size).

The checkpoint's shared experts are mlp.shared_experts (SparseMoE's shared_expert), the
correction bias mlp.gate.e_score_correction_bias. Its multi-token-prediction layers
(num_nextn_predict_layers, after the decoder's) are not read. GGUF: llama.cpp's `glm4moe`
(block_count counts those layers too: nextn_predict_layers of them are not the decoder's)."""

from __future__ import annotations

from servelm.models.families.deepseek import ScoreBiasNames

_GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
                     "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                     "ffn_up_shexp": "mlp.shared_experts.up_proj",
                     "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def _moe(n: int, *, experts: int, per_tok: int, moe_inter: int, shared: int, dense: int,
         groups: int, used_groups: int, norm_topk: bool, scaling: float) -> dict:
    """The ModelConfig fields of GLM-4-MoE's experts, from either checkpoint kind."""
    return {"num_experts": experts, "num_experts_per_tok": per_tok,
            "moe_intermediate_size": moe_inter, "shared_expert_intermediate_size": moe_inter * shared,
            "norm_topk_prob": norm_topk, "dense_layers": tuple(range(min(dense, n))),
            "extra": {"router_scoring": "sigmoid_grouped", "n_group": groups,
                      "topk_group": used_groups, "score_bias": True,
                      "shared_expert_gate": False, "routed_scaling": scaling}}


class Glm4Moe(ScoreBiasNames):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    gguf_architectures = ("glm4moe",)
    renames = {"shared_experts": "shared_expert"}
    gguf_layer_names = _GGUF_LAYER_NAMES

    def hf_config(self, cfg, base):
        params = cfg.get("rope_parameters") or {}
        factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.5
        out = {"qk_norm": bool(cfg.get("use_qk_norm", False)),
               "attention_bias": bool(cfg.get("attention_bias", False)),
               **_moe(base["num_layers"], experts=int(cfg["n_routed_experts"]),
                      per_tok=int(cfg["num_experts_per_tok"]),
                      moe_inter=int(cfg["moe_intermediate_size"]),
                      shared=int(cfg.get("n_shared_experts") or 0),
                      dense=int(cfg.get("first_k_dense_replace") or 0),
                      groups=int(cfg.get("n_group") or 1), used_groups=int(cfg.get("topk_group") or 1),
                      norm_topk=bool(cfg.get("norm_topk_prob", True)),
                      scaling=float(cfg.get("routed_scaling_factor") or 1.0))}
        if factor < 1.0:
            out["rotary_dim"] = int(base["head_dim"] * factor)
        return out

    def gguf_config(self, get, base, tensor_names):
        # rope.dimension_count (the partial rotary) is read with the common keys.
        n = base["num_layers"] - int(get("nextn_predict_layers", 0) or 0)
        return {"num_layers": n,
                "attention_bias": any(t.endswith(".attn_q.bias") for t in tensor_names),
                "qk_norm": any(t.endswith(".attn_q_norm.weight") for t in tensor_names),
                **_moe(n, experts=base.get("num_experts", 0),
                       per_tok=base.get("num_experts_per_tok", 0),
                       moe_inter=base.get("moe_intermediate_size", 0),
                       shared=int(get("expert_shared_count", 0)),
                       dense=int(get("leading_dense_block_count", 0)),
                       groups=int(get("expert_group_count", 1) or 1),
                       used_groups=int(get("expert_group_used_count", 1) or 1),
                       norm_topk=bool(get("expert_weights_norm", True)),
                       scaling=float(get("expert_weights_scale", 1.0)))}

