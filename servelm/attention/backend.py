"""The attention backend interface: what a backend supports, the metadata it builds for a
step, and how it attends one layer over the paged cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from servelm.attention.metadata import AttentionMetadata, AttnGroup, FlatTokens


@dataclass(frozen=True)
class AttentionSpec:
    """What a configuration asks of attention, all known at start-up."""

    device: torch.device
    dtype: torch.dtype      # the activations'
    kv_dtype: torch.dtype   # the KV pool's storage dtype (int8 / float8_e4m3fn: quantised)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # Attention scores soft-capped (cap * tanh(scores / cap), Gemma 2).
    logit_softcap: float | None = None
    # A learned logit per query head joins each query's softmax denominator (attention
    # sinks, gpt-oss: Attention.sinks).
    sinks: bool = False
    # Chunked local attention on some layers (Llama 4's attention_chunk_size: a query sees
    # only the keys of its own chunk, floor(pos / chunk) equal; Attention.chunk; it is no
    # sliding window).
    attention_chunk: int | None = None
    # (KV heads, head dim) of the layers whose shape is not (num_kv_heads, head_dim): Gemma
    # 4's global layers. A backend that cannot run one of them declines the model.
    layer_shapes: tuple[tuple[int, int], ...] = ()

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every layer's (KV heads, head dim), each once, the model's own first."""
        return tuple(dict.fromkeys(((self.num_kv_heads, self.head_dim), *self.layer_shapes)))

    def asks(self) -> frozenset[str]:
        """The model options this spec asks of a backend's kernels ("softcap", "sinks",
        "chunk": AttentionBackend.options)."""
        return frozenset(name for name, on in (("softcap", self.logit_softcap),
                                               ("sinks", self.sinks),
                                               ("chunk", self.attention_chunk)) if on)

    def kernels_lack(self, runs: frozenset[str] = frozenset()) -> str | None:
        """What this spec asks of the options a backend's kernels do not run (`runs`:
        AttentionBackend.options), as its reason to decline after "<its kernels> do not",
        or None."""
        missing = self.asks() - runs
        return next((why for name, why in _LACKING.items() if name in missing), None)


# What a backend's kernels "do not" do when they lack an option, in the order checked.
_LACKING = {"softcap": "soft-cap attention scores",
            "sinks": "add attention sinks to the softmax",
            "chunk": ("run chunked local attention (keys from the query's own chunk only, "
                      "which is no sliding window)")}


class AttentionBackend:
    """One way of attending over the paged KV cache. Stateless: one instance per kind, in
    the registry (servelm.attention.BACKENDS)."""

    name: str = ""
    # The model options (AttentionSpec: "softcap", "sinks", "chunk") its kernels run; the
    # reference runs them all.
    options: frozenset[str] = frozenset()
    # Attention reads each row's own keys in place: a batch padded to a longer block table
    # costs nothing (DecodeGraphs may pad any decode batch to one width).
    reads_in_place: bool = False
    # Decode rows come first as RaggedDecodes (the C++ decode op's input, and the
    # DecodeStack's): the cpu backends.
    ragged_decodes: bool = False

    def unsupported(self, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run `spec` (device, KV dtype, shapes, whether its
        kernels are built), or None when it can. Head dims and sliding windows its kernels
        do not take are not reasons: those groups fall back to the reference."""
        raise NotImplementedError

    def build(self, seqs: list, block_size: int, num_queries_per_kv: int,
              device: torch.device) -> tuple[FlatTokens, AttentionMetadata]:
        """The step's flat tokens, in the order this backend attends them, and its metadata
        (SeqInputs in; see model_runner.build_forward_batch)."""
        raise NotImplementedError

    def forward(self, layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor] | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """One layer's attention: q [T, H, D] of every flat token (K/V already written),
        k_cache / v_cache [num_blocks, block_size, KVH, D] (with their (k, v) scales when
        quantised); returns [T, H * D]. `layer` (an Attention) gives scale and window."""
        raise NotImplementedError


def per_group(q: torch.Tensor, groups: list[AttnGroup],
              attend: Callable[[torch.Tensor, AttnGroup], torch.Tensor],
              outs: list[torch.Tensor] | None = None) -> torch.Tensor:
    """attend(q of the group's tokens, group) for each group, concatenated after `outs` (the
    rows attended before the groups); one group covering every token takes q whole."""
    if not outs and len(groups) == 1 and groups[0].start == 0 and groups[0].end == q.shape[0]:
        return attend(q, groups[0])
    outs = (outs or []) + [attend(q[g.start:g.end], g) for g in groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
