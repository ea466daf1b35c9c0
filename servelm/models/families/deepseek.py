"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): Llama's
pre-norm layer with

- multi-head latent attention (servelm/models/mla.py: the query through q_proj or the
  low-rank q_a_proj / q_a_layernorm / q_b_proj, keys and values from one latent of
  kv_lora_rank and a rope key shared by the heads; the rotary on the rope dims only, by
  adjacent pairs (V2 always, V3 with rope_interleave); q/k heads of qk_nope_head_dim +
  qk_rope_head_dim, value heads of v_head_dim), served from a latent cache (one row of
  kv_lora_rank + qk_rope_head_dim per token and layer: ModelConfig.cache_layout) with
  kv_b_proj absorbed into the query and the output (prompt chunks expanded where that
  costs fewer FLOPs; its rows split at load into w_uk and w_uv, which stay in the model
  dtype); the softmax scale qk_head_dim ** -0.5 times YaRN's
  mscale(mscale_all_dim) squared where the rotary is scaled,
- dense MLPs on the first first_k_dense_replace layers, then MoE layers: n_routed_experts
  of moe_intermediate_size, num_experts_per_tok chosen, their weights times
  routed_scaling_factor, and n_shared_experts shared experts on every token, ungated (one
  MLP of n_shared_experts * moe_intermediate_size). V2's router: softmax, top k
  (topk_method greedy) or group-limited (group_limited_greedy: n_group groups, the top k
  among the topk_group best by their best expert), not renormalised (transformers ignores
  V2's norm_topk_prob; every V2 checkpoint sets it false); V3's: sigmoid scores, the choice
  biased by e_score_correction_bias among the topk_group groups whose two best sum highest,
  renormalised with norm_topk_prob.

The checkpoint's shared experts are mlp.shared_experts (SparseMoE's shared_expert), the
correction bias mlp.gate.e_score_correction_bias (SparseMoE's), the full-rank query
projection self_attn.q_proj (LatentAttention's query_proj: the decoder fuses q_proj
tensors into qkv_proj otherwise).

GGUF: llama.cpp's `deepseek2` (both versions; V3 told by its sigmoid gating or its
correction bias, exp_probs_b). Its converters wrote two layouts: older files keep
kv_b_proj (attn_kv_b) and per-head key and value lengths; newer ones state the latent as
one KV head (key_length = kv_lora_rank + rope, the heads' lengths in key_length_mla /
value_length_mla) and store kv_b_proj split, attn_k_b [heads, kv_lora_rank, nope]
(transposed) and attn_v_b [heads, v, kv_lora_rank]: the absorbed form's w_uk and w_uv.
YaRN's mscale comes as rope.scaling.yarn_log_multiplier (0.1 * mscale_all_dim)."""

from __future__ import annotations

import math

import re

from servelm.models.family import Family
from servelm.models.hf_keys import rope_scaling

# llama.cpp's deepseek2 layer tensors (GGUF blk.N.<part>) -> HF names.
_GGUF_LAYER_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                     "attn_q_b": "self_attn.q_b_proj",
                     "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                     "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                     "attn_kv_b": "self_attn.kv_b_proj",
                     "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                     "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                     "ffn_up_shexp": "mlp.shared_experts.up_proj",
                     "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def _mscale(factor: float, m: float) -> float:
    """YaRN's attention scale (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _mla_config(base, *, nope, rope, v, q_lora, kv_lora, scaling, pairwise, experts,
                experts_per_tok, moe_inter, shared, dense, router, norm_topk, routed_scaling,
                mlp_bias) -> dict:
    """ModelConfig fields of a DeepSeek model, from either checkpoint kind."""
    scale = (nope + rope) ** -0.5
    if scaling and scaling["rope_type"] == "yarn" and scaling.get("mscale_all_dim"):
        m = _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    # The attention's own heads: a key and a value per query head (expanded from the
    # latent); the cache holds the latent: one row of kv_lora_rank + rope per token, its
    # values read from the same row (LatentAttention's absorbed form).
    return {"num_kv_heads": base["num_heads"], "head_dim": nope + rope,
            "cache_kv_heads": 1, "cache_head_dim": kv_lora + rope, "cache_planes": 1,
            "rotary_dim": rope, "attn_scale": scale, "mlp_bias": mlp_bias,
            "num_experts": experts, "num_experts_per_tok": experts_per_tok,
            "moe_intermediate_size": moe_inter, "shared_expert_intermediate_size": shared,
            "norm_topk_prob": norm_topk, "dense_layers": tuple(dense),
            "extra": {"mla": {"q_lora_rank": q_lora and int(q_lora), "kv_lora_rank": kv_lora,
                              "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
                              "v_head_dim": v, "rope_pairwise": pairwise},
                      **router, "shared_expert_gate": False, "routed_scaling": routed_scaling}}


class ScoreBiasNames(Family):
    """The router's correction bias (DeepSeek-V3's grouped sigmoid router, GLM-4-MoE's too):
    mlp.gate.e_score_correction_bias in an HF checkpoint, blk.N.exp_probs_b.bias in
    llama.cpp's, SparseMoE's mlp.e_score_correction_bias."""

    def gguf_name(self, gguf_name):
        m = re.fullmatch(r"blk\.(\d+)\.exp_probs_b\.bias", gguf_name)
        if m:
            return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
        return super().gguf_name(gguf_name)

    def internal_name(self, hf_name):
        return super().internal_name(hf_name).replace(".mlp.gate.e_score_correction_bias",
                                                      ".mlp.e_score_correction_bias")


class DeepseekV2(ScoreBiasNames):
    name = "deepseek_v2"
    architectures = ("DeepseekV2ForCausalLM",)
    gguf_architectures = ("deepseek2",)  # both versions: gguf_config tells V3 apart
    gguf_layer_names = _GGUF_LAYER_NAMES
    renames = {"shared_experts": "shared_expert", "q_proj": "query_proj"}
    v3 = False

    def _router(self, cfg) -> tuple[dict, bool]:
        """The MoE's router options (ModelConfig.extra) and norm_topk_prob."""
        method = cfg.get("topk_method") or "greedy"
        if method == "greedy":
            return {"router_scoring": "softmax"}, False
        if method == "group_limited_greedy":
            return {"router_scoring": "softmax_grouped", "n_group": int(cfg["n_group"]),
                    "topk_group": int(cfg["topk_group"])}, False
        raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r} "
                         f"(supported: greedy, group_limited_greedy)")

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        experts = int(cfg.get("n_routed_experts") or 0)
        moe_inter = int(cfg.get("moe_intermediate_size") or 0)
        router, norm_topk = self._router(cfg)
        return _mla_config(
            base, nope=int(cfg["qk_nope_head_dim"]), rope=int(cfg["qk_rope_head_dim"]),
            v=int(cfg["v_head_dim"]), q_lora=cfg.get("q_lora_rank"),
            kv_lora=int(cfg["kv_lora_rank"]), scaling=rope_scaling(cfg),
            pairwise=bool(cfg.get("rope_interleave", True)) if self.v3 else True,
            experts=experts,
            experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_inter=moe_inter, shared=moe_inter * int(cfg.get("n_shared_experts") or 0),
            dense=tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), n))),
            router=router, norm_topk=norm_topk,
            routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            mlp_bias=bool(cfg.get("mlp_bias", False)))

    def gguf_config(self, get, base, tensor_names):
        kv_lora = int(get("attention.kv_lora_rank"))
        rope = int(get("rope.dimension_count"))
        if get("attention.key_length_mla"):  # the latent as one KV head, kv_b_proj split
            qk, v = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
        else:  # an older converter's: per-head lengths, kv_b_proj whole
            qk, v = int(get("attention.key_length")), int(get("attention.value_length"))
        scaling = base["rope_scaling"]
        if scaling and scaling["rope_type"] == "yarn":
            # DeepSeek's YaRN: the betas the file states, else those its configs ship; mscale
            # equal to mscale_all_dim (the cos / sin unscaled, the softmax scale times
            # mscale squared).
            m = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            scaling = {**scaling, "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                       "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
                       "mscale": m, "mscale_all_dim": m}
        moe = [i for i in range(base["num_layers"]) if i not in base.get("dense_layers", ())]
        score_bias = bool(moe) and f"blk.{moe[0]}.exp_probs_b.bias" in tensor_names
        v3 = int(get("expert_gating_func", 0)) == 2 or score_bias
        groups = int(get("expert_group_count", 1) or 1)
        used_groups = int(get("expert_group_used_count", 1) or 1)
        if v3:
            router = {"router_scoring": "sigmoid_grouped", "n_group": groups,
                      "topk_group": used_groups, "score_bias": score_bias}
        elif groups > 1:
            router = {"router_scoring": "softmax_grouped", "n_group": groups,
                      "topk_group": used_groups}
        else:
            router = {"router_scoring": "softmax"}
        moe_inter = base.get("moe_intermediate_size", 0)
        q_lora = get("attention.q_lora_rank")
        out = _mla_config(
            base, nope=qk - rope, rope=rope, v=v, q_lora=q_lora, kv_lora=kv_lora,
            scaling=scaling, pairwise=True, experts=base.get("num_experts", 0),
            experts_per_tok=base.get("num_experts_per_tok", 0), moe_inter=moe_inter,
            shared=moe_inter * int(get("expert_shared_count", 0)),
            dense=base.get("dense_layers", ()), router=router,
            norm_topk=bool(get("expert_weights_norm", False)),
            routed_scaling=float(get("expert_weights_scale", 1.0)), mlp_bias=False)
        out["rope_scaling"] = scaling
        if v3:
            out.update(architecture=DeepseekV3.architectures[0], family=DeepseekV3.name)
        return out

    # ---- names and values -----------------------------------------------------------------

    def split(self, name, tensor, cfg):
        """kv_b_proj's weight [heads * (nope + v), kv_lora_rank] as the absorbed attention's
        two per-head matrices: w_uk [heads, nope, kv_lora_rank] (the key rows, which turn a
        query into latent space) and w_uv [heads, v, kv_lora_rank] (the value rows, which
        turn the attention's latent output into each head's value)."""
        if name.endswith(".self_attn.k_b_proj.weight"):  # llama.cpp's [heads, kv_lora, nope]
            return [(name.removesuffix("k_b_proj.weight") + "w_uk", tensor.transpose(1, 2))]
        if name.endswith(".self_attn.v_b_proj.weight"):  # [heads, v, kv_lora]
            return [(name.removesuffix("v_b_proj.weight") + "w_uv", tensor)]
        if not name.endswith(".self_attn.kv_b_proj.weight"):
            return [(name, tensor)]
        mla = cfg.extra["mla"]
        nope, v = mla["qk_nope_head_dim"], mla["v_head_dim"]
        w = tensor.reshape(cfg.num_heads, nope + v, tensor.shape[-1])
        prefix = name.removesuffix("kv_b_proj.weight")
        return [(prefix + "w_uk", w[:, :nope]), (prefix + "w_uv", w[:, nope:])]


class DeepseekV3(DeepseekV2):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    gguf_architectures = ()  # deepseek2 files come through DeepseekV2.gguf_config
    v3 = True

    def _router(self, cfg):
        return {"router_scoring": "sigmoid_grouped", "n_group": int(cfg.get("n_group") or 1),
                "topk_group": int(cfg.get("topk_group") or 1), "score_bias": True}, \
            bool(cfg.get("norm_topk_prob", True))
