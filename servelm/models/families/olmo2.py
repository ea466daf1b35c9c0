"""OLMo 2 and 3: Llama's attention and MLP with norms after each (on their outputs, before they
join the residual stream) and none before, and q/k RMSNorms over the whole q and k
projections (not per head). GGUF: llama.cpp writes both as `olmo2`; an OLMo 3 file is told
by its window, its layer kinds in attention.sliding_window_pattern (a bool a layer, true
where it slides), one rotary base, YaRN (its attention factor as rope.scaling.attn_factor)
on the full layers only."""

from __future__ import annotations

from servelm.models.family import Family
from servelm.models.hf_keys import SLIDING, hf_layer_types, rope_theta, window_pattern


class Olmo2(Family):
    name = "olmo2"
    architectures = ("Olmo2ForCausalLM",)
    gguf_architectures = ("olmo2",)
    # Its post_attention_layernorm follows attention (the decoder's attn_out_norm); the
    # decoder's own pre-norms are NoNorms, with no weights.
    renames = {"post_attention_layernorm": "attn_out_norm",
               "post_feedforward_layernorm": "mlp_out_norm"}
    gguf_layer_names = {"post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
    # Tensor parallelism: the q / k norms' weights by heads (each rank normalises its heads
    # over the whole projection's mean square: sharding.WholeNorm).
    shard_rules = ((r"\.self_attn\.q_norm\.weight$", 0, "q_heads", "head"),
                   (r"\.self_attn\.k_norm\.weight$", 0, "kv_heads", "head"))

    def _common(self):
        return {"qk_norm": True, "qk_norm_whole": True, "sandwich_norms": True,
                "pre_norms": False}

    def hf_config(self, cfg, base):
        return {**self._common(), "attention_bias": bool(cfg.get("attention_bias", False)),
                "layer_types": hf_layer_types(cfg, base["num_layers"]),
                "sliding_window": cfg.get("sliding_window")}

    def gguf_config(self, get, base, tensor_names):
        window = get("attention.sliding_window")
        if not window:
            return self._common()
        # A bool a layer; without it, OLMo 3's default: every fourth layer full.
        types = window_pattern(get("attention.sliding_window_pattern", 4), base["num_layers"])
        scaling = base["rope_scaling"]
        if scaling and scaling["rope_type"] == "yarn":
            scaling = {**scaling, "beta_fast": 32.0, "beta_slow": 1.0}
            if get("rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
        out = {**self._common(), "architecture": Olmo3.architectures[0], "family": Olmo3.name,
               "layer_types": types, "sliding_window": int(window), "rope_scaling": scaling}
        if scaling and "rope_local_theta" not in base:  # (the file's freq_base_swa, else)
            out["rope_local_theta"] = base["rope_theta"]  # the same base, unscaled
        return out


class Olmo3(Olmo2):
    """OLMo 3: OLMo 2's layer with sliding-window layers (three in four by default), their
    rotary without the full layers' scaling (a second table where the two differ)."""

    name = "olmo3"
    architectures = ("Olmo3ForCausalLM",)
    gguf_architectures = ()  # olmo2 files come through Olmo2.gguf_config, which tells them apart

    def hf_config(self, cfg, base):
        out = {**super().hf_config(cfg, base)}
        n = base["num_layers"]
        if cfg.get("sliding_window") and not cfg.get("layer_types"):
            out["layer_types"] = window_pattern(4, n)
        local = rope_theta(cfg, SLIDING)
        if local != base["rope_theta"] or base.get("rope_scaling"):
            out["rope_local_theta"] = local
        return out
