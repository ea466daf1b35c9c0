"""Multi-head latent attention (DeepSeek-V2 / V3) over a latent paged cache.

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
or the query heads per KV head decline it (AttentionBackend.unsupported).

A prompt chunk scores each of its queries against every key over kv_lora_rank + rope dims
per head; where that costs more than expanding its context's rows into per-head keys and
values (LatentAttention._expands: fresh prompts, long chunks), its group runs the expanded
form instead (vLLM's choice too): the rows gathered through the block tables, through W_UK
and W_UV, then SDPA per head; decode rows and the other groups go to the backend absorbed,
in the same step. W_UK and W_UV are split from kv_b_proj's weight at load
(DeepseekV2.split) and stay dense in the model dtype: the engine's weight quantisation acts
on linear layers only. The softmax scale is the family's (qk_head_dim ** -0.5, YaRN's
mscale folded in), unchanged by the absorption.
"""

from __future__ import annotations

from dataclasses import replace
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
        # How prompt chunks attend: "auto" (the form with fewer FLOPs, _expands), or always
        # "absorbed" / "expanded" (tests compare the forms; the cpu backends' ragged decode
        # rows are absorbed whatever it says).
        self.prompt_form = "auto"
        self._rotary = apply_rotary_pairwise if rope_pairwise else apply_rotary

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.query_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv_cache: tuple[torch.Tensor, ...],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's cache row is written; with rows, only those tokens' outputs go
        through o_proj and are returned (Attention.forward's contract). kv_cache: the
        layer's (k, v[, k_scale, v_scale]), V the same rows as K."""
        cache, scale = kv_cache[0], (kv_cache[2] if len(kv_cache) > 2 else None)
        T, h, c = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self._query(x).view(T, h, self.qk_dim)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([c, self.rope_dim], -1)
        k_rot = self._rotary(k_rot.reshape(T, 1, self.rope_dim), cos, sin)
        row = torch.cat((self.kv_a_layernorm(latent).view(T, 1, c), k_rot), dim=-1)
        kv_quant.write(cache, scale, batch.slot_mapping, row)
        q_nope, q_rot = q[..., :self.nope], self._rotary(q[..., self.nope:], cos, sin)
        meta = batch.attn
        expand = [self._expands(g) for g in meta.groups]
        if not any(expand):  # decodes (the hot path): every row absorbed, one backend call
            out = self._absorbed(q_nope, q_rot, cache, scale, meta)
            return self.o_proj(self._values(out if rows is None else out[rows]))
        # Prompt chunks whose expansion costs less run expanded; the rest (decode rows, short
        # chunks over long contexts) absorbed, through the backend with their groups only.
        # The parts cover the flat tokens in order: decode rows first, then the groups.
        parts = []
        kept = [g for g, e in zip(meta.groups, expand) if not e]
        nd = meta.decodes.num if meta.decodes is not None else 0
        spans = [(0, nd)] * bool(nd) + [(g.start, g.end) for g in kept]
        if spans:
            out = self._values(self._absorbed(q_nope, q_rot, cache, scale,
                                              replace(meta, groups=kept), spans))
            parts += out.split([e - s for s, e in spans])
        starts = [s for s, _ in spans]
        for g, e in zip(meta.groups, expand):
            if e:
                parts.append(self._expanded(q_nope[g.start:g.end], q_rot[g.start:g.end],
                                            cache, scale, g))
                starts.append(g.start)
        out = torch.cat([parts[i] for i in sorted(range(len(parts)), key=starts.__getitem__)])
        return self.o_proj(out if rows is None else out[rows])

    def _expands(self, group) -> bool:
        """Whether a group runs expanded: prompt_form "expanded", or "auto" and a prompt
        chunk whose expansion costs fewer FLOPs. Per head, Q queries and L keys (the group's
        padded sizes), c = kv_lora_rank: absorbed, Q * L * 4 (c + rope) + Q * 2 c (nope + v)
        (the scores and the weighted sum over the latent rows, W_UK and W_UV on the queries);
        expanded, Q * L * 4 d + L * 2 c (nope + v) (d: the larger of the q/k and v heads,
        the keys and values of every cached token through kv_b_proj). DeepSeek-V2-Lite
        (c 512, rope 64, d 192) expands when Q (1536 L + 262144) > 262144 L: a fresh prompt
        of a few blocks, a chunk of more than ~170 tokens over a long context; decodes and
        speculative drafts' few tokens stay absorbed."""
        if self.prompt_form != "auto":
            return self.prompt_form == "expanded"
        B, Q = group.pad_index.shape
        if Q == 1:
            return False
        L = group.block_tables.shape[1] * group.block_size
        uv = 2 * self.kv_lora_rank * (self.nope + self.v_dim)
        d = max(self.qk_dim, self.v_dim)
        return Q * L * 4 * d + L * uv < Q * L * 4 * self.head_dim + Q * uv

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, cache: torch.Tensor,
                  scale: torch.Tensor | None, meta,
                  spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The backend's attention over the latent rows for meta's rows (its decode rows and
        groups, the flat tokens of `spans`; None: all): each head's query
        [W_UK^T q_nope | q_rope], V read from K; returns the rows' attended latents
        [rows, heads, kv_lora_rank] in the backend's order."""
        if spans is None:
            q = self._latent_query(q_nope, q_rot)
        else:  # only the backend's rows are computed (and read: it indexes the flat tokens)
            q = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.head_dim)
            for s, e in spans:
                q[s:e] = self._latent_query(q_nope[s:e], q_rot[s:e])
        scales = None if scale is None else (scale, scale)
        out = meta.backend.forward(self, q, cache, cache, scales, meta)
        return out.view(out.shape[0], self.num_heads, self.head_dim)[..., :self.kv_lora_rank]

    def _latent_query(self, q_nope: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
        """[W_UK^T q_nope | q_rope] of each head: q_nope [h, n, nope] @ W_UK [h, nope, c]."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        return torch.cat((q_lat, q_rot), dim=-1)

    def _values(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attended latents [n, heads, c] -> each head's value-space output through W_UV:
        [h, n, c] @ W_UV^T [h, c, v] -> [n, heads * v]."""
        n = o_lat.shape[0]
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2))
        return o.transpose(0, 1).reshape(n, self.num_heads * self.v_dim)

    def _expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, cache: torch.Tensor,
                  scale: torch.Tensor | None, group) -> torch.Tensor:
        """One group's attention in the expanded form: its sequences' latent rows gathered
        through the block tables and expanded by kv_b_proj (W_UK, W_UV) into every head's
        key [nope | the shared rope key] and value, then SDPA with the causal mask of the
        group's positions (without one for a single fresh prompt); the head sizes padded to
        the larger with zeros (which change neither q . k nor the output's kept dims, and let
        PyTorch's CPU flash attention take it). Returns [n, heads * v] in flat order."""
        B, Q = group.pad_index.shape
        h, c, D = self.num_heads, self.kv_lora_rank, self.head_dim
        flat = group.block_tables.view(-1)
        rows = kv_quant.gather_rows(cache.view(cache.shape[0], -1), flat)
        if scale is not None:
            s = scale.view(scale.shape[0], -1).index_select(0, flat)
            rows = kv_quant.dequantize(rows.view(*s.shape, D), s, q_nope.dtype)
        rows = rows.view(B, -1, D)                                           # [B, L, D]
        L = rows.shape[1]
        lat, k_rope = rows[..., :c], rows[..., c:]
        k = torch.einsum("blc,hnc->bhln", lat, self.w_uk)
        v = torch.einsum("blc,hvc->bhlv", lat, self.w_uv)
        k = torch.cat((k, k_rope.unsqueeze(1).expand(B, h, L, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)[group.pad_index].transpose(1, 2)  # [B, h, Q, qk]
        d = max(self.qk_dim, self.v_dim)
        if self.qk_dim < d:
            q, k = F.pad(q, (0, d - self.qk_dim)), F.pad(k, (0, d - self.qk_dim))
        if self.v_dim < d:
            v = F.pad(v, (0, d - self.v_dim))
        if B == 1 and group.start_pos and group.start_pos[0] == 0:
            # One fresh prompt: query i sees keys 0..i (the padding keys past it, none).
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            keys = torch.arange(L, device=rows.device)
            mask = (keys <= group.query_pos.unsqueeze(-1)).unsqueeze(1)     # [B, 1, Q, L]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        o = o[..., :self.v_dim].transpose(1, 2).reshape(B * Q, h * self.v_dim)
        return o[group.unpad_index]
