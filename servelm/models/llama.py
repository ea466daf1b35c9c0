"""Llama family (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2-style qkv bias)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from servelm.kernels import load_ops
from servelm.models.config import ModelConfig
from servelm.models.layers import Attention, ForwardBatch, GatedMLP, RMSNorm, RotaryEmbedding


def _has_decode_stack() -> bool:
    """Whether quant.cpp registered the DecodeStack class: it builds empty on a CPU without
    AVX-512 BF16 (torch.classes raises RuntimeError, not AttributeError, for a missing one)."""
    try:
        torch.classes.servelm_quant.DecodeStack
    except (RuntimeError, AttributeError):
        return False
    return True


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, batch, kv_cache, rows=None):
        """rows: only these flat tokens continue past attention (the last layer, when only
        the sampled tokens' hidden states are wanted); every token's K/V is still written."""
        a = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache, rows=rows)
        x = (x if rows is None else x[rows]) + a
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, delta, residual, cos, sin, batch, kv_cache, rows=None):
        """Kernel path: residual += delta (the previous layer's MLP output, None for the first
        layer) fused into the norms; returns (this layer's MLP output, residual), residual
        updated in place (or, with rows as in forward, its rows taken first)."""
        if delta is None:
            h = self.input_layernorm(residual, kernels=True)
        else:
            h = self.input_layernorm.add_forward(delta, residual, kernels=True)
        a = self.self_attn(h, cos, sin, batch, kv_cache, rows=rows)
        if rows is not None:
            residual = residual[rows]
        h = self.post_attention_layernorm.add_forward(a, residual, kernels=True)
        return self.mlp(h, kernels=True), residual

    def linears(self) -> tuple[nn.Module, ...]:
        """qkv, o, gate_up, down: the order the DecodeStack takes them."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)

    def decode_stack_args(self) -> tuple | None:
        """This layer's part of a `servelm_quant.DecodeStack`: (weights, group sizes, norms,
        qkv bias), when all four linear layers run on the int4/int8/bf16 C++ kernels and only
        qkv has a bias; else None. Not for tensor-parallel layers (their subclasses all-reduce
        the attention and MLP outputs, which the stack does not)."""
        from servelm.quantization import kernel_weights

        if type(self.self_attn) is not Attention or type(self.mlp) is not GatedMLP:
            return None
        linears = self.linears()
        attn = self.self_attn
        parts = [kernel_weights(m) for m in linears]
        if any(p is None for p in parts) or any(m.bias is not None for m in linears[1:]):
            return None
        bias = attn.qkv_proj.bias
        return ([t for ts, _ in parts for t in ts], [g for _, g in parts],
                [self.input_layernorm.weight, self.post_attention_layernorm.weight],
                torch.empty(0) if bias is None else bias)


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
        self.fused_decode = False  # set by bind_decode_layers
        self._decode_stack, self._decode_kv, self._decode_max_rows = None, None, 0

    def bind_decode_layers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Once the weights are final (quantised, on the CPU with the C++ kernels): bind every
        decoder layer and its KV cache (with the embedding, rotary tables and final norm) into
        one `servelm_quant.DecodeStack`, which then runs decode-only bf16 batches of up to its
        max_rows() (4096) from token ids to the final norm in one C++ call per step,
        bit-identical to the per-op path (from 48 rows, 24 with an int8 layer, its matmuls
        decode each weight tile once, as the per-op kernels do; bf16 tiles from 8). Only
        when every layer's linear layers are int4/int8/bf16 kernel layers for one row, and
        then for the rows they all run on them (servelm.tuning may choose other methods for
        more rows). The runner binds it unless KernelConfig.fused_decode is off."""
        from servelm.quantization import stack_rows

        self.fused_decode, self._decode_stack, self._decode_kv = False, None, None
        if not (load_ops("quant") and load_ops("ops") and _has_decode_stack()):
            return False
        parts = [layer.decode_stack_args() for layer in self.layers]
        if any(p is None for p in parts) or self.embed_tokens.weight.dtype != torch.bfloat16:
            return False
        rows = min(stack_rows(m) for layer in self.layers for m in layer.linears())
        attn = self.layers[0].self_attn
        self._decode_stack = torch.classes.servelm_quant.DecodeStack(
            [t for p in parts for t in p[0]], [g for p in parts for g in p[1]],
            [t for p in parts for t in p[2]], [p[3] for p in parts],
            [k for k, _ in kv_caches], [v for _, v in kv_caches], self.config.rms_norm_eps,
            attn.num_heads, attn.num_kv_heads, attn.scale)
        # Embedding, rotary rows and the final norm too: run_tokens is the whole step. The
        # rotary tables rounded to bf16 once (rounding commutes with the per-step gather).
        bf16 = torch.bfloat16
        self._decode_stack.bind_io(self.embed_tokens.weight, self.rotary.cos.to(bf16).contiguous(),
                                   self.rotary.sin.to(bf16).contiguous(), self.norm.weight)
        self._decode_kv = kv_caches
        self._decode_max_rows = min(rows, self._decode_stack.max_rows())
        self.fused_decode = True
        return True

    def decode_stack_takes(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           rows: int) -> bool:
        """Whether the DecodeStack runs a decode-only step of `rows` rows over kv_caches (it
        is bound, to these caches, and takes that many rows)."""
        return self.fused_decode and rows <= self._decode_max_rows and kv_caches is self._decode_kv

    def decode_step(self, input_ids: list[int], positions: list[int], slots: list[int],
                    tables: list[int], context_lens: list[int]) -> torch.Tensor:
        """A decode-only step that decode_stack_takes, from plain lists (as
        model_runner.decode_lists builds them): the final hidden states [M, hidden], the same
        bits as forward() on the equivalent batch."""
        return self._decode_stack.run_lists(input_ids, positions, slots, tables, context_lens)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                sampled_only: bool = False) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] of all scheduled tokens, or with
        sampled_only those of batch.logits_indices [S, hidden]: then the last layer's o_proj
        and MLP run for those rows only (prompt positions whose logits nobody reads skip
        1/num_layers of the prompt's matmuls)."""
        n, last = batch.input_ids.shape[0], len(self.layers) - 1
        rows = batch.logits_indices if sampled_only and batch.logits_indices.shape[0] < n else None
        fused = batch.kernels and batch.num_decodes == n and self.decode_stack_takes(kv_caches, n)
        if fused and rows is None:  # the whole step, embedding to final norm, in one call
            return self._decode_stack.run_tokens(batch.input_ids, batch.positions, batch.slot_mapping,
                                                 batch.decode_block_tables, batch.decode_context_lens)
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        if batch.kernels:
            # The residual stream is updated in place by the fused add + RMSNorm kernels.
            delta = None
            if fused:
                delta = self._decode_stack.run(x, cos, sin, batch.slot_mapping,
                                               batch.decode_block_tables, batch.decode_context_lens)
                if rows is not None:
                    delta, x = delta[rows], x[rows]
            else:
                for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                    delta, x = layer.forward_fused(delta, x, cos, sin, batch, kv,
                                                   rows=rows if i == last else None)
            return self.norm.add_forward(delta, x, kernels=True)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, batch, kv, rows=rows if i == last else None)
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
