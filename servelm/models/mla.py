"""Multi-head latent attention (DeepSeek-V2 / V3), absorbed form, over a latent paged cache.

A token's keys and values come from one compressed latent: kv_a_proj_with_mqa projects
the hidden state to a latent of kv_lora_rank (then kv_a_layernorm) and one rope key of
qk_rope_head_dim shared by every head; the checkpoint's kv_b_proj expands the latent to each
head's non-rotary key (qk_nope_head_dim: its rows W_UK) and value (v_head_dim: W_UV). The
query comes from q_proj, or through a low-rank pair q_a_proj -> q_a_layernorm -> q_b_proj
(q_lora_rank set), each head's [nope, rope] parts. The rotary turns only the rope parts: of
adjacent pairs of dims (DeepSeek-V2 always, V3 with rope_interleave; its output the pairs'
first members then their second, as transformers' V3 writes it, q and k alike so q . k is
the pairwise one), or the rotate-half form.

The cache holds what the expansion starts from, one row per token and layer:
[latent (kv_lora_rank) | rotated rope key (qk_rope_head_dim)] (ModelConfig.cache_layout:
1 KV head of kv_lora_rank + qk_rope_head_dim, one plane). kv_b_proj is absorbed instead of
applied to every cached token (associativity): q_nope . (W_UK c) = (W_UK^T q_nope) . c, so
each head's query becomes [W_UK^T q_nope | q_rope] against the cached rows, a multi-query
attention with one KV head whose values are the same rows: the output's first kv_lora_rank
dims are the attention-weighted latent (the rope dims of the output are dropped), which
W_UV turns into the head's value-space output before o_proj. Any attention backend runs it
unchanged (the K and V caches are one tensor); those whose kernels do not take the head dim
or the query heads per KV head decline it (AttentionBackend.unsupported). Prompt chunks run
the absorbed form too. W_UK and W_UV are split from kv_b_proj's weight at load
(DeepseekV2.split) and stay dense in the model dtype: the engine's weight quantisation acts
on linear layers only. The softmax scale is the family's (qk_head_dim ** -0.5, YaRN's
mscale folded in), unchanged by the absorption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from servelm.models import kv_quant
from servelm.models.layers import RMSNorm, apply_rotary

if TYPE_CHECKING:
    from servelm.attention.metadata import ForwardBatch

# transformers' DeepseekV2/V3RMSNorm default: q_a_layernorm and kv_a_layernorm are built
# without the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def apply_rotary_pairwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, r] turned by pairs of adjacent dims (2i, 2i + 1 at frequency i); cos,
    sin [T, r] are the rotate-half tables (each frequency twice). Returns the rotated pairs'
    first members, then their second (transformers' apply_rotary_pos_emb_interleave)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (module docstring). Attributes the attention
    backends read: scale, window (None), softcap (None); num_heads, num_kv_heads (1) and
    head_dim (kv_lora_rank + qk_rope_head_dim) are what they see."""

    def __init__(self, hidden: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, bias: bool = False,
                 rope_pairwise: bool = True):
        super().__init__()
        self.options = dict(hidden=hidden, num_heads=num_heads, q_lora_rank=q_lora_rank,
                            kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                            scale=scale, bias=bias, rope_pairwise=rope_pairwise)
        h = num_heads
        self.num_heads, self.num_kv_heads = h, 1
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.head_dim = kv_lora_rank + qk_rope_head_dim  # the cache row the backends attend
        if q_lora_rank is None:
            self.query_proj = nn.Linear(hidden, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, h * self.qk_dim, bias=False)
        self.low_rank_q = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj's key rows and value rows, a matrix per head (DeepseekV2.split).
        self.w_uk = nn.Parameter(torch.empty(h, qk_nope_head_dim, kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(h, v_head_dim, kv_lora_rank))
        self.o_proj = nn.Linear(h * v_head_dim, hidden, bias=bias)
        self.scale = scale
        self.window = self.softcap = None
        self._rotary = apply_rotary_pairwise if rope_pairwise else apply_rotary

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.query_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv_cache: tuple[torch.Tensor, ...],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's cache row is written; with rows, only those tokens' outputs go
        through W_UV and o_proj and are returned (Attention.forward's contract). kv_cache:
        the layer's (k, v[, k_scale, v_scale]), V the same rows as K."""
        cache, scale = kv_cache[0], (kv_cache[2] if len(kv_cache) > 2 else None)
        T, h, c = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self._query(x).view(T, h, self.qk_dim)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([c, self.rope_dim], -1)
        k_rot = self._rotary(k_rot.reshape(T, 1, self.rope_dim), cos, sin)
        row = torch.cat((self.kv_a_layernorm(latent).view(T, 1, c), k_rot), dim=-1)
        kv_quant.write(cache, scale, batch.slot_mapping, row)
        # Each head's query in latent space: q_nope [h, T, nope] @ W_UK [h, nope, c].
        q_lat = torch.bmm(q[..., :self.nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        q = torch.cat((q_lat, self._rotary(q[..., self.nope:], cos, sin)), dim=-1)
        scales = None if scale is None else (scale, scale)
        out = batch.attn.backend.forward(self, q, cache, cache, scales, batch.attn)
        if rows is not None:
            out = out[rows]
        n = out.shape[0]
        # The attended latent of each head [h, n, c] @ W_UV^T [h, c, v] -> [n, h * v].
        o_lat = out.view(n, h, self.head_dim)[..., :c].transpose(0, 1)
        o = torch.bmm(o_lat, self.w_uv.transpose(1, 2)).transpose(0, 1).reshape(n, h * self.v_dim)
        return self.o_proj(o)
