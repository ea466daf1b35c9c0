"""GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorms with biases, the attention and a non-gated
exact-GELU MLP in parallel (each on its own norm; use_parallel_residual false: one after
the other), biases on every linear layer, a partial rotary (a quarter of each head by
default), and a fused query_key_value tensor holding each head's q, k and v together
(reordered at load, ModelConfig.qkv_per_head). llama.cpp's `gptneox` files hold it as q | k
| v already (its converter reorders it), and say use_parallel_residual in their metadata."""

from __future__ import annotations

import re

from servelm.models.families.stablelm import partial_rotary
from servelm.models.family import Family

_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_fast": "gelu_tanh"}
_NAMES = ((r"^(?:gpt_neox|model)\.", ""), (r"^embed_in\.", "embed_tokens."),
          (r"^embed_out\.", "lm_head."), (r"^final_layer_norm\.", "norm."),
          (r"\.attention\.query_key_value\.", ".self_attn.qkv_proj."),
          (r"\.attention\.dense\.", ".self_attn.o_proj."),
          (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj."))


class GptNeoX(Family):
    name = "gpt_neox"
    architectures = ("GPTNeoXForCausalLM",)
    gguf_architectures = ("gptneox",)
    # llama.cpp's names -> the checkpoint's (then _NAMES); its norms are the HF ones'.
    gguf_layer_names = {"attn_qkv": "attention.query_key_value", "attn_output": "attention.dense",
                        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}

    @staticmethod
    def _layers(parallel: bool, bias: bool, act: str, eps: float) -> dict:
        return {"norm_type": "layer", "rms_norm_eps": eps, "parallel_block": parallel,
                "parallel_mlp_norm": parallel, "mlp_gated": False, "mlp_bias": True,
                "hidden_act": act, "attention_bias": bias, "attention_out_bias": bias}

    def gguf_config(self, get, base, tensor_names):
        # No hidden_act in the file: Pythia's and GPT-NeoX-20B's exact GELU (llama.cpp runs
        # its own approximation of it). rope.dimension_count is read with the common keys.
        return {**self._layers(bool(get("use_parallel_residual", True)),
                               "blk.0.attn_qkv.bias" in tensor_names, "gelu",
                               float(get("attention.layer_norm_epsilon", 1e-5))),
                "qkv_per_head": False}

    def hf_config(self, cfg, base):
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"GPT-NeoX with hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(_ACTS)})")
        bias = bool(cfg.get("attention_bias", True))
        parallel = bool(cfg.get("use_parallel_residual", True))
        params = cfg.get("rope_parameters") or {}
        factor = cfg.get("rotary_pct") or params.get("partial_rotary_factor") or 0.25
        return {**self._layers(parallel, bias, _ACTS[act], float(cfg.get("layer_norm_eps", 1e-5))),
                "qkv_per_head": True,
                "rope_theta": float(cfg.get("rotary_emb_base") or base["rope_theta"]),
                **partial_rotary({"partial_rotary_factor": factor}, base["head_dim"], 0.25)}

    def internal_name(self, hf_name):
        name = hf_name
        for pattern, repl in _NAMES:
            name = re.sub(pattern, repl, name)
        return name
