"""GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorms with biases, the attention and a non-gated
exact-GELU MLP in parallel (each on its own norm; use_parallel_residual false: one after
the other), biases on every linear layer, a partial rotary (a quarter of each head by
default), and a fused query_key_value tensor holding each head's q, k and v together
(reordered at load, ModelConfig.qkv_per_head)."""

from __future__ import annotations

import re

from servelm.models.families.stablelm import partial_rotary
from servelm.models.family import Family

_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_fast": "gelu_tanh"}
_NAMES = ((r"^gpt_neox\.", ""), (r"^embed_in\.", "embed_tokens."),
          (r"^embed_out\.", "lm_head."), (r"^final_layer_norm\.", "norm."),
          (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
          (r"\.attention\.dense\.", ".self_attn.o_proj."),
          (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj."))


class GptNeoX(Family):
    name = "gpt_neox"
    architectures = ("GPTNeoXForCausalLM",)
    gguf_architectures = ()  # llama.cpp's gptneox spelling is not read here yet

    def hf_config(self, cfg, base):
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"GPT-NeoX with hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(_ACTS)})")
        bias = bool(cfg.get("attention_bias", True))
        parallel = bool(cfg.get("use_parallel_residual", True))
        params = cfg.get("rope_parameters") or {}
        factor = cfg.get("rotary_pct") or params.get("partial_rotary_factor") or 0.25
        return {"norm_type": "layer", "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
                "parallel_block": parallel, "parallel_mlp_norm": parallel,
                "mlp_gated": False, "mlp_bias": True, "hidden_act": _ACTS[act],
                "attention_bias": bias, "attention_out_bias": bias, "qkv_per_head": True,
                "rope_theta": float(cfg.get("rotary_emb_base") or base["rope_theta"]),
                **partial_rotary({"partial_rotary_factor": factor}, base["head_dim"], 0.25)}

    def internal_name(self, hf_name):
        name = hf_name
        for pattern, repl in _NAMES:
            name = re.sub(pattern, repl, name)
        return name
