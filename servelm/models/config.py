"""ModelConfig: one normalised description of a model, from GGUF metadata or HF config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# GGUF architecture name -> HF architecture name used by the registry.
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, whatever file format they came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        """Parameter count of the Llama-shaped model (embeddings counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        if cfg.get("sliding_window") not in (None, 0) and cfg.get("use_sliding_window", True):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("sliding-window attention is not supported "
                                 f"(sliding_window={cfg['sliding_window']})")
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """meta: GGUF key -> value (scalars, strings, lists)."""
        arch = meta["general.architecture"]
        if arch not in _GGUF_ARCHS:
            raise ValueError(f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(sorted(_GGUF_ARCHS))})")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {"rope_type": get("rope.scaling.type"),
                       "factor": float(get("rope.scaling.factor", 1.0)),
                       "original_max_position_embeddings":
                           int(get("rope.scaling.original_context_length", 0))}
        if scaling and scaling["rope_type"] != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {scaling['rope_type']!r}")
        if get("attention.sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        return cls(
            architecture=_GGUF_ARCHS[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """HF keeps scaling in rope_scaling (transformers 4) or rope_parameters (5)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    return {**scaling, "rope_type": kind}
