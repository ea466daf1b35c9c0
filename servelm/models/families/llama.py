"""Llama 2/3/3.1+ (llama3 rope scaling), SmolLM, and Mistral (a sliding window on every
layer when its config sets one); Mixtral-shaped MoE GGUFs are llama.cpp's `llama` too."""

from __future__ import annotations

from servelm.models.hf_keys import SLIDING, hf_layer_types
from servelm.models.family import Family


class Llama(Family):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    gguf_architectures = ("llama",)
    gguf_permute_qk = True

    def hf_config(self, cfg, base):
        return {"layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window")}

    def gguf_config(self, get, base, tensor_names):
        out = {}
        if "blk.0.ffn_gate_inp.weight" in tensor_names:  # llama.cpp's Mixtral
            out.update(family="mixtral", architecture="MixtralForCausalLM", norm_topk_prob=True)
        window = get("attention.sliding_window")
        if window:
            out.update(sliding_window=int(window), layer_types=(SLIDING,) * base["num_layers"])
        return out


class Mistral(Llama):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    gguf_architectures = ("mistral",)
