"""Llama family (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2-style qkv bias)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from servelm.models.config import ModelConfig
from servelm.models.layers import Attention, ForwardBatch, GatedMLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, batch, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, delta, residual, cos, sin, batch, kv_cache):
        """Kernel path: residual += delta (the previous layer's MLP output, None for the first
        layer) fused into the norms; returns this layer's MLP output and updates residual."""
        if delta is None:
            h = self.input_layernorm(residual, kernels=True)
        else:
            h = self.input_layernorm.add_forward(delta, residual, kernels=True)
        a = self.self_attn(h, cos, sin, batch, kv_cache)
        h = self.post_attention_layernorm.add_forward(a, residual, kernels=True)
        return self.mlp(h, kernels=True)


class LlamaForCausalLM(nn.Module):
    """Token ids -> hidden states over a paged KV cache; logits only where asked."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Always a module, so quantisation and tensor parallelism can swap it like any other
        # linear layer; tied checkpoints share the embedding's parameter.
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] of all scheduled tokens."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        if batch.kernels:
            # The residual stream is updated in place by the fused add + RMSNorm kernels.
            delta = None
            for layer, kv in zip(self.layers, kv_caches):
                delta = layer.forward_fused(delta, x, cos, sin, batch, kv)
            return self.norm.add_forward(delta, x, kernels=True)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, batch, kv)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> fp32 logits [S, vocab]."""
        return self.lm_head(hidden).float()

    # Fused parameters and the HF names stacked into them, in row order.
    _STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be filled exactly once."""
        if self.config.tie_word_embeddings:
            # Re-tie: moving the model off the meta device gives each module its own tensor.
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding serves as the head
            stacked = next(((fused, part) for fused, parts in self._STACKED.items()
                            for part in parts if f".{part}." in name), None)
            if stacked is None:
                self._copy(params, name, tensor)
                loaded.add(name)
                continue
            fused, part = stacked
            target = name.replace(f".{part}.", f".{fused}.")
            pending.setdefault(target, {})[part] = tensor
            parts = self._STACKED[fused]
            if all(p in pending[target] for p in parts):
                got = pending.pop(target)
                self._copy(params, target, torch.cat([got[p] for p in parts]))
                loaded.add(target)
        missing = set(params) - loaded
        if missing or pending:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:5]}")

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor)
