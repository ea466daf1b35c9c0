"""The cpu backend: servelm's C++ kernels (servelm/kernels/csrc/ops.cpp) attend in place
over the block tables. Decode rows come first, one ragged batch (`paged_decode_attention`);
prompt chunks run a flash-style op (`paged_prefill_attention`) group by group, falling back
to the reference for head dims the op does not take. Both ops run any sliding window,
Llama 4's attention chunks, Gemma 2's soft-capped scores, gpt-oss's attention sinks, and
int8 caches with their scales."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from servelm.attention.backend import AttentionBackend, AttentionSpec, per_group
from servelm.attention.metadata import (AttentionMetadata, AttnGroup, FlatTokens, RaggedDecodes,
                                        bucket, decode_lists)
from servelm.attention.reference import paged_attention
from servelm.kernels import load_ops

# KV storage dtypes the C++ ops read (fp8 is not one: kv_quant's int8 only).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
# The C++ decode op's limits (kernels/csrc/decode_attention.h: kMaxD, kMaxG): a head dim of
# at most 576 and at most 128 query heads a KV head (DeepSeek-V3's latent cache: one KV head
# of 576 for 128 query heads; Gemma 4's 512-dim global heads). Its prompt op falls back to
# the reference per group; the decode rows have no fallback, so a spec past them is declined.
MAX_HEAD_DIM, MAX_QUERIES_PER_KV = 576, 128


def shape_unsupported(spec: AttentionSpec) -> str | None:
    """Why the C++ decode op cannot take spec's heads (MAX_HEAD_DIM, MAX_QUERIES_PER_KV)
    on some layer, or None."""
    for kvh, d in spec.shapes():  # every layer's (Gemma 4's differ)
        g = spec.num_heads // kvh
        if d > MAX_HEAD_DIM or g > MAX_QUERIES_PER_KV:
            return (f"servelm's C++ decode attention takes head dims up to {MAX_HEAD_DIM} and "
                    f"up to {MAX_QUERIES_PER_KV} query heads a KV head, not a layer's {d} and "
                    f"{g}")
    return None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            group: AttnGroup, scale: float, window: int | None = None,
                            scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None,
                            chunk: int | None = None) -> torch.Tensor:
    """`paged_attention` for prompt chunks on CPU with the C++ kernels: one flash-style op
    (`servelm_ops.paged_prefill_attention`) reads K/V in place through the block tables,
    keeps the softmax online in fp32 and skips the masked keys (the upper triangle, and
    those before a window or chunk); no padding, gather or score matrix. Head dims it does
    not take (not a multiple of 16, or above MAX_HEAD_DIM) use the reference. An int8 cache is read
    with its scales (dequantised as each chunk of keys is packed).
    """
    d = q.shape[-1]
    if d % 16 or d > MAX_HEAD_DIM:
        return paged_attention(q, k_cache, v_cache, group, scale, window, scales, softcap,
                               sinks, chunk)
    tables, cu_q, start_pos = group.prefill_metadata
    ks, vs = scales or (None, None)
    return torch.ops.servelm_ops.paged_prefill_attention(
        q, k_cache, v_cache, tables, cu_q, start_pos, scale, ks, vs, window or 0, chunk or 0,
        softcap or 0.0, sinks)


def _options_only_the_op_runs(group: AttnGroup, window: int | None, softcap, sinks,
                              chunk) -> bool:
    """Whether a prompt group asks what only servelm's op runs (a soft-cap, sinks, chunks,
    or a window some query's keys overrun): the other prompt paths hand it to the op."""
    return bool(softcap or sinks is not None or chunk or not group.fits_window(window))


# Groups whose longest sequence attends fewer keys than this stay on the C++ op, which takes
# a whole group in one call: a sequence at a time, PyTorch's flash attention loses to it on
# many short prompts (docs/kernels.md, "Choose the kernels"). time_prompt measures from here up.
SDPA_MIN_KEYS = 512


def _flash_for_cpu():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def sdpa_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           group: AttnGroup, scale: float, window: int | None = None,
                           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           chunk: int | None = None) -> torch.Tensor:
    """`paged_prefill_attention` on PyTorch's CPU flash attention (oneDNN's brgemm: AMX
    where the CPU has it), a sequence at a time: its blocks gathered (the chunk's keys and
    every earlier one), GQA heads repeated, the chunk's own keys attended causally and,
    after a cached prefix or an earlier chunk, the earlier keys attended whole, the two
    merged by their log-sum-exp. A group of short sequences (SDPA_MIN_KEYS), an int8
    cache, or an option only the op runs (_options_only_the_op_runs) takes the C++ op
    (which falls back to the reference where it must)."""
    plan = group.__dict__.get("_sdpa_plan")
    if plan is None:  # host copies, once a step (every layer shares the group)
        cu = group.prefill_metadata[1].tolist()
        keys = max(s + cu[b + 1] - cu[b] for b, s in enumerate(group.start_pos))
        plan = group.__dict__["_sdpa_plan"] = (cu, group.block_tables, keys)
    cu, tables, keys = plan
    if (scales is not None or keys < SDPA_MIN_KEYS
            or _options_only_the_op_runs(group, window, softcap, sinks, chunk)):
        return paged_prefill_attention(q, k_cache, v_cache, group, scale, window, scales,
                                       softcap, sinks, chunk)
    flash = _flash_for_cpu()
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    h = q.shape[1]
    g = h // kvh
    out = q.new_empty(q.shape[0], h * d)
    for b, start in enumerate(group.start_pos):
        c0, c1 = cu[b], cu[b + 1]
        n = c1 - c0
        if n == 0:
            continue
        t = start + n
        rows = tables[b, :-(-t // bs)]
        k = k_cache.index_select(0, rows).view(-1, kvh, d)[:t]
        shared = v_cache is k_cache  # V read from K's rows (a latent cache): gathered once
        v = k if shared else v_cache.index_select(0, rows).view(-1, kvh, d)[:t]
        if g > 1:
            k = k.repeat_interleave(g, 1)
            v = k if shared else v.repeat_interleave(g, 1)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        qb = q[c0:c1].transpose(0, 1).unsqueeze(0)                           # [1, H, n, D]
        o, lse = flash(qb, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)[:2]
        if start:
            o0, lse0 = flash(qb, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)[:2]
            m = torch.maximum(lse, lse0)
            w, w0 = torch.exp(lse - m).unsqueeze(-1), torch.exp(lse0 - m).unsqueeze(-1)
            o = ((o.float() * w + o0.float() * w0) / (w + w0)).to(q.dtype)
        out[c0:c1] = o[0].transpose(0, 1).reshape(n, h * d)
    return out


class CpuBackend(AttentionBackend):
    """Every single-token row (decode) first, in input order, described by one padded int32
    block table and its context lengths (RaggedDecodes: what the DecodeStack reads too);
    prompt chunks in padded groups as the reference forms them."""

    name = "cpu"
    options = frozenset({"softcap", "sinks", "chunk"})
    ragged_decodes = True

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"servelm's C++ kernels run on the CPU, not {spec.device.type}"
        if spec.kv_dtype not in KV_DTYPES:
            return (f"servelm's C++ kernels cannot read a {spec.kv_dtype} KV cache "
                    f"(kv_cache_dtype 'fp8'; 'int8' they read)")
        if lack := spec.kernels_lack(self.options):
            return f"servelm's C++ attention kernels do not {lack}"
        if shape := shape_unsupported(spec):
            return shape
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
        flat = FlatTokens(input_ids, positions, slots, logits_indices, sampled, list(decodes))
        groups = flat.add_grouped(seqs, prompts, keys, nd, block_size, num_queries_per_kv, device)
        dec = RaggedDecodes(
            nd, torch.tensor(tables, dtype=torch.int32, device=device).view(nd, max_blocks),
            torch.tensor(lens, dtype=torch.int32, device=device))
        return flat, AttentionMetadata(self, groups, dec)

    def forward(self, layer, q, k_cache, v_cache, scales, meta):
        nd, outs = meta.decodes.num, []
        softcap, sinks, chunk = (getattr(layer, a, None) for a in ("softcap", "sinks", "chunk"))
        if nd:
            # Decode rows read K/V in place through their block tables (ragged lengths).
            ks, vs = scales or (None, None)
            o = torch.ops.servelm_ops.paged_decode_attention(
                q if nd == q.shape[0] else q[:nd], k_cache, v_cache, meta.decodes.block_tables,
                meta.decodes.context_lens, layer.scale, layer.window or 0, ks, vs, chunk or 0,
                softcap or 0.0, sinks)
            outs.append(o.view(nd, -1))
        # Prompt chunks: flash-style attention over the block tables.
        return per_group(q, meta.groups, lambda qg, g: self.prompt_attention(
            qg, k_cache, v_cache, g, layer.scale, layer.window, scales, softcap, sinks, chunk),
            outs)

    prompt_attention = staticmethod(paged_prefill_attention)


def amx_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          group: AttnGroup, scale: float, window: int | None = None,
                          scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None,
                          chunk: int | None = None) -> torch.Tensor:
    """`paged_prefill_attention` with both matmuls on AMX tiles
    (`servelm_amx_attention.paged_prefill_attention`, kernels/csrc/amx_attention.cpp): the
    group's keys packed once into tile layouts, then 16 queries of a KV head at a time, an
    whole-row fp32 softmax per row between the two matmuls. bf16 only, head dims 64 and 128; any
    other dtype or head dim, an int8 cache, or an option only the op runs
    (_options_only_the_op_runs) takes the C++ op (which falls back to the reference where
    it must)."""
    d = q.shape[-1]
    if (scales is not None or q.dtype != torch.bfloat16 or d not in (64, 128)
            or _options_only_the_op_runs(group, window, softcap, sinks, chunk)):
        return paged_prefill_attention(q, k_cache, v_cache, group, scale, window, scales,
                                       softcap, sinks, chunk)
    tables, cu_q, start_pos = group.prefill_metadata
    return torch.ops.servelm_amx_attention.paged_prefill_attention(q, k_cache, v_cache, tables,
                                                                  cu_q, start_pos, scale)


def amx_available() -> bool:
    """Whether servelm's AMX kernel is built and may run here (an AMX-BF16 CPU whose OS
    grants the tile state)."""
    return load_ops("amx_attention") and bool(torch.ops.servelm_amx_attention.available())


class CpuSdpaBackend(CpuBackend):
    """The cpu backend with prompt chunks on PyTorch's CPU flash attention
    (sdpa_prefill_attention) instead of servelm's op: decodes, the DecodeStack and the fused
    ops as the cpu backend has them. Which of the two prompt paths is faster depends on the
    CPU (AMX or not), so "auto" times both at start-up (servelm.attention.select)."""

    name = "cpu_sdpa"
    prompt_attention = staticmethod(sdpa_prefill_attention)

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if _flash_for_cpu() is None:
            return "this PyTorch has no CPU flash attention op"
        return super().unsupported(spec)


class CpuAmxBackend(CpuBackend):
    """The cpu backend with bf16 prompt chunks on servelm's AMX kernel
    (amx_prefill_attention); decodes, the DecodeStack and the fused ops as the cpu backend
    has them. "auto" times it with the other cpu prompt paths (servelm.attention.select)."""

    name = "cpu_amx"
    prompt_attention = staticmethod(amx_prefill_attention)

    def unsupported(self, spec: AttentionSpec) -> str | None:
        reason = super().unsupported(spec)
        if reason is not None:
            return reason
        if spec.dtype != torch.bfloat16:
            return f"servelm's AMX attention kernel runs bf16, not {spec.dtype}"
        if not amx_available():
            return "this CPU (or its OS) offers no AMX-BF16 tiles, or the kernel is not built"
        return None


PROMPT_TOKENS = (512, 2048)  # the prompt chunks the prompt paths are timed on


def time_prompt(backends: list[CpuBackend], spec: AttentionSpec) -> dict[str, list[float]]:
    """µs per call of each backend's prompt attention, one fresh prompt of each of
    PROMPT_TOKENS in spec's shape, over random K/V: timed as the linear methods are
    (servelm.tuning's interleaved rounds, the best kept), after a warm-up call."""
    from servelm.tuning import _time_interleaved

    bs, h, kvh, d = spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(0)
    blocks = -(-max(PROMPT_TOKENS) // bs)
    kc, vc = (torch.randn(blocks, bs, kvh, d, generator=g).to(spec.dtype) for _ in range(2))
    best: dict[str, list[float]] = {b.name: [] for b in backends}
    for n in PROMPT_TOKENS:
        seq = SimpleNamespace(token_ids=list(range(n)), start_pos=0,
                              block_table=list(range(-(-n // bs))), sample=True,
                              all_logits=False, num_logits=1)
        group = backends[0].build([seq], bs, h // kvh, spec.device)[1].groups[0]
        q = torch.randn(n, h, d, generator=g).to(spec.dtype)
        calls = {b.name: [lambda x, b=b: b.prompt_attention(x, kc, vc, group, d ** -0.5)]
                 for b in backends}
        for (call,) in calls.values():
            call(q)  # the warm-up _time_interleaved expects
        for name, sec in _time_interleaved(calls, q).items():
            best[name].append(sec * 1e6)
    return best
