"""The cpu backend: servelm's C++ kernels (servelm/kernels/csrc/ops.cpp) attend in place
over the block tables. Decode rows come first, one ragged batch (`paged_decode_attention`,
any window, int8 caches with their scales); prompt chunks run a flash-style op
(`paged_prefill_attention`) group by group, falling back to the reference where the op
does not go (head dims, a window some query's keys overrun)."""

from __future__ import annotations

import torch

from servelm.attention.backend import AttentionBackend, AttentionSpec, per_group
from servelm.attention.metadata import (AttentionMetadata, AttnGroup, FlatTokens, RaggedDecodes,
                                        bucket, decode_lists)
from servelm.attention.reference import paged_attention
from servelm.kernels import load_ops

# KV storage dtypes the C++ ops read (fp8 is not one: kv_quant's int8 only).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            group: AttnGroup, scale: float, window: int | None = None,
                            scales: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> torch.Tensor:
    """`paged_attention` for prompt chunks on CPU with the C++ kernels: one flash-style op
    (`servelm_ops.paged_prefill_attention`) reads K/V in place through the block tables,
    keeps the softmax online in fp32 and skips the masked upper triangle; no padding, gather
    or score matrix. Head dims it does not take (not a multiple of 16, or above 256), and a
    sliding window some query's keys overrun, use SDPA. An int8 cache is read with its
    scales (dequantised as each chunk of keys is packed).
    """
    d = q.shape[-1]
    if d % 16 or d > 256 or not group.fits_window(window):
        return paged_attention(q, k_cache, v_cache, group, scale, window, scales)
    tables, cu_q, start_pos = group.prefill_metadata
    ks, vs = scales or (None, None)
    return torch.ops.servelm_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu_q,
                                                         start_pos, scale, ks, vs)


class CpuBackend(AttentionBackend):
    """Every single-token row (decode) first, in input order, described by one padded int32
    block table and its context lengths (RaggedDecodes: what the DecodeStack reads too);
    prompt chunks in padded groups as the reference forms them."""

    name = "cpu"

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"servelm's C++ kernels run on the CPU, not {spec.device.type}"
        if spec.kv_dtype not in KV_DTYPES:
            return (f"servelm's C++ kernels cannot read a {spec.kv_dtype} KV cache "
                    f"(kv_cache_dtype 'fp8'; 'int8' they read)")
        if not load_ops("ops"):
            return "servelm's C++ kernels are not built here (no compiler, or SERVELM_NO_KERNELS)"
        return None

    def build(self, seqs, block_size, num_queries_per_kv, device):
        decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        nd = len(decodes)
        if nd == len(seqs):
            prompts, keys = [], []
        else:
            prompts = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
            keys = [bucket(seqs[i], block_size) for i in prompts]
            prompts = [prompts[j] for j in sorted(range(len(prompts)), key=keys.__getitem__)]
            keys.sort()
        input_ids, positions, slots, tables, lens, max_blocks = decode_lists(
            [seqs[i] for i in decodes], block_size)
        logits_indices = [r for r, i in enumerate(decodes) if seqs[i].sample or seqs[i].all_logits]
        sampled = [i for i in decodes if seqs[i].sample or seqs[i].all_logits]
        flat = FlatTokens(input_ids, positions, slots, logits_indices, sampled)
        groups = flat.add_grouped(seqs, prompts, keys, nd, block_size, num_queries_per_kv, device)
        dec = RaggedDecodes(
            nd, torch.tensor(tables, dtype=torch.int32, device=device).view(nd, max_blocks),
            torch.tensor(lens, dtype=torch.int32, device=device))
        return flat, AttentionMetadata(self, groups, dec)

    def forward(self, layer, q, k_cache, v_cache, scales, meta):
        nd, outs = meta.decodes.num, []
        if nd:
            # Decode rows read K/V in place through their block tables (ragged lengths).
            ks, vs = scales or (None, None)
            o = torch.ops.servelm_ops.paged_decode_attention(
                q if nd == q.shape[0] else q[:nd], k_cache, v_cache, meta.decodes.block_tables,
                meta.decodes.context_lens, layer.scale, layer.window or 0, ks, vs)
            outs.append(o.view(nd, -1))
        # Prompt chunks: flash-style attention over the block tables.
        return per_group(q, meta.groups, lambda qg, g: paged_prefill_attention(
            qg, k_cache, v_cache, g, layer.scale, layer.window, scales), outs)
