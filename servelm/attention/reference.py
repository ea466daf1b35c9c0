"""The reference backend: K/V gathered block by block into padded groups, SDPA with a
causal (or sliding-window, or chunked) mask (explicit matmuls where scores are soft-capped
or the softmax has sinks). The eager fp32 path every other backend is tested against; it
runs any device, KV dtype, head dim, window, attention chunk, soft-cap and attention sink."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelm.attention.backend import AttentionBackend, AttentionSpec, per_group
from servelm.attention.metadata import AttentionMetadata, AttnGroup, FlatTokens, bucket
from servelm.models import kv_quant


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    group: AttnGroup, scale: float, window: int | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """Attention of one group's queries over keys/values read through its block tables.

    q: [n, H, D] for the group's n flat tokens; k_cache, v_cache: [num_blocks, block_size, KVH, D].
    Returns [n, H * D]. Grouped-query heads share their KV head without copying it:
    the G query heads of one KV head are laid out as G * Q rows of one attention call.
    A quantised cache comes with its (k, v) scales [num_blocks, block_size, KVH]: the
    gathered blocks are dequantised to q's dtype (never the whole cache). softcap: the
    scaled scores become softcap * tanh(scores / softcap) before the mask and softmax
    (Gemma 2), in explicit matmuls (SDPA has no such option). sinks [H]: one logit per query
    head that joins every query's softmax as a key without a value (gpt-oss), so the weights
    of the real keys sum to less than one: exp(s_i) / (sum_j exp(s_j) + exp(sink)).
    chunk: chunked local attention (Llama 4): a query at position p sees only the keys
    at positions k <= p with k // chunk == p // chunk.
    """
    B, Q = group.pad_index.shape
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    h = q.shape[1]
    g = h // kvh
    qp = q[group.pad_index]                                          # [B, Q, H, D]
    qp = qp.view(B, Q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, d)
    # Whole blocks are copied as rows (index_select on a 2-D view is several times faster
    # than advanced indexing of the 4-D cache).
    # V may be K's own rows (DeepSeek's latent cache: the same tensor): gathered once.
    shared = v_cache is k_cache
    flat = group.block_tables.view(-1)
    k = kv_quant.gather_rows(k_cache.view(k_cache.shape[0], -1), flat)
    v = k if shared else kv_quant.gather_rows(v_cache.view(v_cache.shape[0], -1), flat)
    if scales is not None:
        ks, vs = (s.view(s.shape[0], -1).index_select(0, flat) for s in scales)
        k = kv_quant.dequantize(k.view(*ks.shape, d), ks, q.dtype)
        v = k if shared else kv_quant.dequantize(v.view(*vs.shape, d), vs, q.dtype)
    k = k.view(B, -1, kvh, d).transpose(1, 2)                           # [B, KVH, L, D]
    v = v.view(B, -1, kvh, d).transpose(1, 2)
    mask = (group.window_mask(window, g) if chunk is None
            else chunk_mask(group, window, chunk, g))
    if softcap or sinks is not None:
        s = torch.matmul(qp, k.transpose(-1, -2)).float() * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is None:
            # A padding row masks every key: its NaNs are dropped by unpad_index below.
            p = torch.softmax(s, dim=-1)
        else:  # the sink as one more column of every row (query head kvh * g + i's rows)
            sink = sinks.float().view(1, kvh, g, 1, 1).expand(B, kvh, g, Q, 1)
            p = torch.softmax(torch.cat((s, sink.reshape(B, kvh, g * Q, 1)), -1), -1)[..., :-1]
        o = torch.matmul(p.to(q.dtype), v)
    else:
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    o = o.view(B, kvh, g, Q, d).permute(0, 3, 1, 2, 4).reshape(B * Q, h * d)
    return o[group.unpad_index]


def chunk_mask(group: AttnGroup, window: int | None, chunk: int, g: int | None = None
               ) -> torch.Tensor:
    """group.window_mask(window, g) less the keys outside each query's chunk of `chunk`
    positions; built once a step per chunk size, kept beside the group's window masks."""
    masks = group.__dict__.setdefault("_masks", {})
    g = g or group.num_queries_per_kv
    key = ("chunk", window, chunk, g)
    if key not in masks:
        base = group.window_mask(window, g)                                # [B, 1, g * Q, L]
        B, Q = group.query_pos.shape
        keys = torch.arange(base.shape[-1], device=group.query_pos.device).view(1, 1, -1)
        same = keys // chunk == group.query_pos.unsqueeze(-1) // chunk     # [B, Q, L]
        masks[key] = base & same.unsqueeze(1).expand(B, g, Q, -1).reshape(B, 1, g * Q, -1)
    return masks[key]


def build_grouped(backend: AttentionBackend, seqs: list, block_size: int, g: int,
                  device: torch.device, ragged: bool) -> tuple[FlatTokens, AttentionMetadata]:
    """Every sequence in a padded group (see metadata.bucket), the groups in key order."""
    keys = [bucket(s, block_size, ragged) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: keys[i])
    flat = FlatTokens()
    groups = flat.add_grouped(seqs, order, [keys[i] for i in order], 0, block_size, g, device)
    return flat, AttentionMetadata(backend, groups)


class ReferenceBackend(AttentionBackend):
    """Gather + SDPA. Groups: decodes apart from prompt chunks, and contexts of the same
    power-of-two block count together (padding costs at most 2x the keys attended)."""

    name = "reference"

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return None

    def build(self, seqs, block_size, num_queries_per_kv, device):
        return build_grouped(self, seqs, block_size, num_queries_per_kv, device, ragged=False)

    def forward(self, layer, q, k_cache, v_cache, scales, meta):
        return per_group(q, meta.groups, lambda qg, g: paged_attention(
            qg, k_cache, v_cache, g, layer.scale, layer.window, scales, layer.softcap,
            getattr(layer, "sinks", None), getattr(layer, "chunk", None)))
