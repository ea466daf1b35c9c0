"""Multi-head latent attention (DeepSeek-V2 / V3), expanded form, over servelm's paged KV
cache.

A token's keys and values come from one compressed latent: kv_a_proj_with_mqa projects
the hidden state to a latent of kv_lora_rank (then kv_a_layernorm) and one rope key of
qk_rope_head_dim shared by every head; kv_b_proj expands the latent to each head's
non-rotary key (qk_nope_head_dim) and value (v_head_dim). The query comes from q_proj, or
through a low-rank pair q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank set), each
head's [nope, rope] parts. The rotary turns only the rope parts: of adjacent pairs of dims
(DeepSeek-V2 always, V3 with rope_interleave; its output the pairs' first members then
their second, as transformers' V3 writes it, q and k alike so q . k is the pairwise one),
or the rotate-half form.

This first form caches the expanded per-head K ([nope, rope], the rope key repeated per
head) and V in the model's ordinary cache: as many KV heads as query heads, head_dim the
larger of the two head sizes, the smaller one zero-padded (zeros change neither q . k nor
the attention's output, whose padded dims are dropped before o_proj). The attention is the
batch's backend's, as for Attention; the softmax scale is the family's (YaRN's mscale
folded in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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
    backends read: scale, window (None), softcap (None)."""

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
        self.num_heads = self.num_kv_heads = h
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.head_dim = max(self.qk_dim, v_head_dim)  # the cache's, the smaller one padded
        self.kv_lora_rank = kv_lora_rank
        if q_lora_rank is None:
            self.query_proj = nn.Linear(hidden, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, h * self.qk_dim, bias=False)
        self.low_rank_q = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, h * (qk_nope_head_dim + v_head_dim), bias=False)
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
        """Every token's expanded K/V is written; with rows, only those tokens' outputs go
        through o_proj and are returned (Attention.forward's contract)."""
        k_cache, v_cache, *scales = kv_cache
        ks, vs = scales or (None, None)
        T, h, d = x.shape[0], self.num_heads, self.head_dim
        q = self._query(x).view(T, h, self.qk_dim)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = self._rotary(q[..., self.nope:], cos, sin)
        k_rot = self._rotary(k_rot.reshape(T, 1, self.rope_dim), cos, sin)
        q = torch.cat((q[..., :self.nope], q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(T, h, self.rope_dim)), dim=-1)
        if self.qk_dim < d:
            q, k = F.pad(q, (0, d - self.qk_dim)), F.pad(k, (0, d - self.qk_dim))
        if self.v_dim < d:
            v = F.pad(v, (0, d - self.v_dim))
        kv_quant.write(k_cache, ks, batch.slot_mapping, k)
        kv_quant.write(v_cache, vs, batch.slot_mapping, v)
        out = batch.attn.backend.forward(self, q, k_cache, v_cache,
                                         tuple(scales) or None, batch.attn)
        if rows is not None:
            out = out[rows]
        if self.v_dim < d:
            out = out.view(-1, h, d)[..., :self.v_dim].reshape(-1, h * self.v_dim)
        return self.o_proj(out)
