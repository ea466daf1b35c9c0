"""Megatron-style sharding of a loaded-shape Llama model, applied as an add-on.

`shard_model` swaps modules of a freshly built model (on the meta device, before any
weight is read) for their 1/N versions with the same call interface:

- attention: this rank's query heads and the KV heads they read (column-parallel rows of
  the fused [q | k | v] projection), `o_proj` row-parallel: the module's output is a
  partial sum, all-reduced once;
- latent attention (DeepSeek): this rank's query heads (their rows of the query projection
  and of kv_b_proj, whole or as llama.cpp's k_b / v_b); the latent's projection, its norm
  and so its cache rows replicated (one row a token serves every head); `o_proj`
  row-parallel by value heads;
- gated MLP: this rank's slice of the intermediate size (column-parallel rows of each of
  gate and up), `down_proj` row-parallel: one all-reduce;
- mixture of experts: every expert sharded as that MLP is (its slice of the expert's
  intermediate size), the router replicated, so each rank routes every token alike and
  runs its slice of the chosen experts: one all-reduce, as for a dense MLP; a shared
  expert (Qwen2-MoE) by its own intermediate slice, its sigmoid gate replicated;
- embedding: this rank's slice of the vocabulary; tokens outside it embed to zero and one
  all-reduce fills them in;
- LM head: the same vocabulary slice (tied checkpoints share the embedding's shard); the
  executor gathers the rank's logits columns on rank 0, the only rank that samples.

Norms and the rotary table are replicated. `ShardPlan.slice_of` tells the loader which
rows or columns of each checkpoint tensor this rank keeps, so no rank materialises the
whole model. The model code itself knows nothing of this: TP=1 is the reference path.

Heads need not divide evenly. With at least as many KV heads as ranks, each rank takes a
contiguous run of KV heads with all of their query heads (SmolLM2's 3 KV heads over 2
ranks: 1 and 2). With more ranks than KV heads, each rank takes one KV head (replicated
on the ranks that share it) and a share of that head's query heads.

A model whose layers differ in head size, KV heads or MLP width (Gemma 4's global layers,
its double-wide MLPs) has a plan a layer (`ShardPlan.for_layer`), each splitting that
layer's own heads and width; every layer must give a rank the same number of query heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.config import ModelConfig
from servelm.models.layers import MLP, Attention, GatedMLP
from servelm.models.linear_attention import GatedDeltaNet
from servelm.models.mla import LatentAttention
from servelm.models.moe import SparseMoE


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of [0, n) in `parts` contiguous pieces whose sizes differ by at most one
    (the larger ones last: rank 0 also schedules and samples)."""
    q, rem = divmod(n, parts)
    start = i * q + max(0, i - (parts - rem))
    return start, start + q + (1 if i >= parts - rem else 0)


@dataclass(frozen=True)
class ShardPlan:
    """Which part of every sharded dimension one rank holds (ranges are [start, end))."""

    rank: int
    world: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int  # width of every rank's logits block in the gather (padded)
    vocab_size: int
    total_heads: int = 0          # the whole model's, for the offsets in fused tensors
    total_kv_heads: int = 0
    total_intermediate: int = 0
    moe_intermediate: tuple[int, int] = (0, 0)  # each expert's slice (MoE models)
    total_moe_intermediate: int = 0
    shared_intermediate: tuple[int, int] = (0, 0)  # the shared expert's slice (Qwen2-MoE)
    v_head_dim: int = 0           # a value head's width (o_proj's input per head)
    kv_b_head: int = 0            # latent attention: kv_b_proj's rows a head (nope + v)
    # Linear attention (Qwen3-Next, Qwen3.5): this rank's key heads and their value heads
    # (r = value heads a key head), the totals, and each head's widths.
    lin_k_heads: tuple[int, int] = (0, 0)
    lin_v_heads: tuple[int, int] = (0, 0)
    total_lin_k_heads: int = 0
    total_lin_v_heads: int = 0
    lin_dk: int = 0
    lin_dv: int = 0
    # A plan a layer where the layers differ in heads or width (else empty: this plan's).
    layer_plans: tuple["ShardPlan", ...] = ()

    @staticmethod
    def _heads(H: int, KVH: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(query heads, KV heads) of this rank, of H query heads over KVH KV heads."""
        g = H // KVH
        if world <= KVH:
            k0, k1 = split_range(KVH, world, rank)
            return (k0 * g, k1 * g), (k0, k1)
        # More ranks than KV heads: share each KV head among consecutive ranks.
        k0 = rank * KVH // world
        sharers = [r for r in range(world) if r * KVH // world == k0]
        if len(sharers) > g:
            raise ValueError(f"tensor_parallel_size {world} cannot be spread over "
                             f"{KVH} KV heads of {g} query heads each")
        a, b = split_range(g, len(sharers), sharers.index(rank))
        return (k0 * g + a, k0 * g + b), (k0, k0 + 1)

    def for_layer(self, layer: int) -> "ShardPlan":
        """The plan of one layer's attention and MLP (this one where the layers are alike)."""
        return self.layer_plans[layer] if self.layer_plans else self

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> "ShardPlan":
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        H, KVH = cfg.num_heads, cfg.num_kv_heads
        mla = cfg.extra.get("mla")
        if mla and cfg.attention_bias and world > 1:
            raise ValueError(f"tensor_parallel_size {world} cannot split latent attention "
                             f"with biases (o_proj's bias would be added on every rank)")
        if world > H:
            raise ValueError(f"tensor_parallel_size {world} is more than the model's {H} "
                             f"attention heads")
        if cfg.qk_norm_whole and world > KVH:
            raise ValueError(f"tensor_parallel_size {world} is more than the model's {KVH} "
                             f"KV heads: its k norm spans every KV head, once each")
        q_heads, (k0, k1) = cls._heads(H, KVH, world, rank)
        if world > cfg.intermediate_size:
            raise ValueError(f"tensor_parallel_size {world} is more than the intermediate "
                             f"size {cfg.intermediate_size}")
        moe = (0, 0)
        if cfg.num_experts:
            if world > cfg.moe_intermediate_size:
                raise ValueError(f"tensor_parallel_size {world} is more than the experts' "
                                 f"intermediate size {cfg.moe_intermediate_size}")
            moe = split_range(cfg.moe_intermediate_size, world, rank)
        shared = (0, 0)
        if cfg.num_experts and cfg.shared_expert_intermediate_size:
            if world > cfg.shared_expert_intermediate_size:
                raise ValueError(f"tensor_parallel_size {world} is more than the shared "
                                 f"expert's intermediate size "
                                 f"{cfg.shared_expert_intermediate_size}")
            shared = split_range(cfg.shared_expert_intermediate_size, world, rank)
        lin = cfg.extra.get("linear_attn")
        lin_fields = {}
        if lin:
            hk, hv = lin["num_k_heads"], lin["num_v_heads"]
            if world > hk:
                raise ValueError(f"tensor_parallel_size {world} is more than the linear-"
                                 f"attention layers' {hk} key heads")
            a, b = split_range(hk, world, rank)
            r = hv // hk
            lin_fields = dict(lin_k_heads=(a, b), lin_v_heads=(a * r, b * r),
                              total_lin_k_heads=hk, total_lin_v_heads=hv,
                              lin_dk=lin["head_k_dim"], lin_dv=lin["head_v_dim"])
        per = -(-cfg.vocab_size // world)
        if (world - 1) * per >= cfg.vocab_size:
            raise ValueError(f"vocabulary of {cfg.vocab_size} cannot be split {world} ways")
        plan = cls(rank=rank, world=world, head_dim=cfg.head_dim, q_heads=q_heads,
                   kv_heads=(k0, k1),
                   intermediate=split_range(cfg.intermediate_size, world, rank),
                   vocab=(rank * per, min(cfg.vocab_size, (rank + 1) * per)),
                   vocab_per_rank=per, vocab_size=cfg.vocab_size, total_heads=H,
                   total_kv_heads=KVH, total_intermediate=cfg.intermediate_size,
                   moe_intermediate=moe, shared_intermediate=shared,
                   total_moe_intermediate=cfg.moe_intermediate_size if cfg.num_experts else 0,
                   v_head_dim=mla["v_head_dim"] if mla else cfg.head_dim,
                   kv_b_head=mla["qk_nope_head_dim"] + mla["v_head_dim"] if mla else 0,
                   **lin_fields)
        if cfg.layer_head_dims or cfg.layer_kv_heads or cfg.extra.get("intermediate_sizes"):
            plan = dataclasses.replace(plan, layer_plans=tuple(
                plan._layer(cfg, i) for i in range(cfg.num_layers)))
        return plan

    def _layer(self, cfg: ModelConfig, i: int) -> "ShardPlan":
        """Layer i's plan: its own head size, KV heads and MLP width split as the model's."""
        kvh, inter, d = cfg.kv_heads_of(i), cfg.intermediate_of(i), cfg.head_dim_of(i)
        q_heads, kv_heads = self._heads(self.total_heads, kvh, self.world, self.rank)
        if q_heads[1] - q_heads[0] != self.num_heads:
            raise ValueError(f"tensor_parallel_size {self.world} gives rank {self.rank} "
                             f"{q_heads[1] - q_heads[0]} query heads on layer {i} ({kvh} KV "
                             f"heads) and {self.num_heads} on the others: the layers' KV "
                             f"heads must split alike")
        if self.world > inter:
            raise ValueError(f"tensor_parallel_size {self.world} is more than layer {i}'s "
                             f"intermediate size {inter}")
        return dataclasses.replace(self, head_dim=d, v_head_dim=d, q_heads=q_heads,
                                   kv_heads=kv_heads, total_kv_heads=kvh,
                                   intermediate=split_range(inter, self.world, self.rank),
                                   total_intermediate=inter)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def moe_intermediate_size(self) -> int:
        return self.moe_intermediate[1] - self.moe_intermediate[0]

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_intermediate[1] - self.shared_intermediate[0]

    @property
    def local_vocab(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model config as this rank sees it: its heads (the KV pool holds only its own
        KV heads) and its intermediate slices; the vocabulary stays the model's."""
        moe = {"moe_intermediate_size": self.moe_intermediate_size,
               "shared_expert_intermediate_size": self.shared_intermediate_size
               } if cfg.num_experts else {}
        lin = cfg.extra.get("linear_attn")
        if lin:  # this rank's key and value heads of every linear-attention layer
            moe["extra"] = {**cfg.extra, "linear_attn": {
                **lin, "num_k_heads": self.lin_k_heads[1] - self.lin_k_heads[0],
                "num_v_heads": self.lin_v_heads[1] - self.lin_v_heads[0]}}
        if self.layer_plans:  # each layer's own KV heads and MLP width
            if cfg.layer_kv_heads:
                moe["layer_kv_heads"] = tuple(p.num_kv_heads for p in self.layer_plans)
            if cfg.extra.get("intermediate_sizes"):
                moe["extra"] = {**moe.get("extra", cfg.extra), "intermediate_sizes": tuple(
                    p.intermediate_size for p in self.layer_plans)}
        return dataclasses.replace(cfg, num_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size, **moe)

    _RULES = (
        # (name pattern, dim, which range, unit)
        (r"\.self_attn\.q_proj\.(weight|bias)$", 0, "q_heads", "head"),
        (r"\.self_attn\.(k|v)_proj\.(weight|bias)$", 0, "kv_heads", "head"),
        (r"\.self_attn\.o_proj\.weight$", 1, "q_heads", "v_head"),
        (r"\.self_attn\.sinks$", 0, "q_heads", "one"),  # gpt-oss: a sink logit a head
        # Phi's and GPT-NeoX's o_proj (dense); GPT-NeoX's query_key_value, each head's q, k
        # and v together (reordered after slicing: ModelConfig.qkv_per_head).
        (r"\.(self_attn|attention)\.dense\.weight$", 1, "q_heads", "v_head"),
        (r"\.attention\.query_key_value\.(weight|bias)$", 0, "q_heads", "qkv_head"),
        # Linear attention (gated DeltaNet) by key heads and their value heads: Qwen3-Next's
        # in_proj_qkvz / in_proj_ba grouped per key head; Qwen3.5's parts apart (in_proj_qkv
        # and the convolution below, as q | k | v); out_proj's columns by value heads.
        (r"\.linear_attn\.in_proj_qkvz\.weight$", 0, "lin_k_heads", "qkvz_group"),
        (r"\.linear_attn\.in_proj_ba\.weight$", 0, "lin_k_heads", "ba_group"),
        (r"\.linear_attn\.in_proj_z\.weight$", 0, "lin_v_heads", "lin_dv"),
        (r"\.linear_attn\.in_proj_[ab]\.weight$", 0, "lin_v_heads", "one"),
        (r"\.linear_attn\.(A_log|dt_bias)$", 0, "lin_v_heads", "one"),
        (r"\.linear_attn\.out_proj\.weight$", 1, "lin_v_heads", "lin_dv"),
        # Latent attention (DeepSeek): the low-rank query's expansion by head; kv_b_proj's
        # per-head key and value rows (whole, or llama.cpp's k_b / v_b [heads, ...]). The
        # latent's own projection (kv_a_proj_with_mqa) is replicated: every rank caches it.
        (r"\.self_attn\.q_b_proj\.weight$", 0, "q_heads", "head"),
        (r"\.self_attn\.kv_b_proj\.weight$", 0, "q_heads", "kv_b_head"),
        (r"\.self_attn\.(k|v)_b_proj\.weight$", 0, "q_heads", "one"),
        (r"\.mlp\.shared_experts?\.(gate|up)_proj\.weight$", 0, "shared_intermediate", "one"),
        (r"\.mlp\.shared_experts?\.down_proj\.weight$", 1, "shared_intermediate", "one"),
        (r"\.mlp\.(gate|up)_proj\.weight$", 0, "intermediate", "one"),
        (r"\.mlp\.down_proj\.weight$", 1, "intermediate", "one"),
        # Non-gated MLPs (layers.MLP), in each family's spelling: up, then down.
        (r"\.mlp\.(c_fc|fc1|dense_h_to_4h)\.(weight|bias)$", 0, "intermediate", "one"),
        (r"\.mlp\.(c_proj|fc2|dense_4h_to_h)\.weight$", 1, "intermediate", "one"),
        (r"(^|\.)(embed_tokens|embed_in)\.weight$", 0, "vocab", "one"),
        (r"(^|\.)(lm_head|embed_out)\.(weight|bias)$", 0, "vocab", "one"),
        # Experts, one tensor each (HF; Mixtral spells gate, down, up w1, w2, w3) ...
        (r"\.(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", 0,
         "moe_intermediate", "one"),
        (r"\.(mlp|block_sparse_moe)\.experts\.\d+\.(down_proj|w2)\.weight$", 1,
         "moe_intermediate", "one"),
        # ... or all of them in one: GGUF's [E, I, H] / [E, H, I], transformers 5's down
        # (Gemma 4's experts sit beside the MLP: layers.N.experts).
        (r"\.(mlp|block_sparse_moe)\.experts\.(gate_proj|up_proj)\.weight$", 1,
         "moe_intermediate", "one"),
        (r"\.(mlp|block_sparse_moe|layers\.\d+)\.experts\.down_proj(\.weight)?$", 2,
         "moe_intermediate", "one"),
        (r"\.mlp\.experts\.(gate_proj|up_proj)\.bias$", 1, "moe_intermediate", "one"),
        (r"\.block_sparse_moe\.output_linear\.weight$", 2, "moe_intermediate", "one"),  # Granite
        # Llama 4's feed_forward: its shared expert, a dense layer's MLP, the experts' down
        # [E, I, H] (gate_up below).
        (r"\.feed_forward\.shared_expert\.(gate|up)_proj\.weight$", 0, "shared_intermediate",
         "one"),
        (r"\.feed_forward\.shared_expert\.down_proj\.weight$", 1, "shared_intermediate", "one"),
        (r"\.feed_forward\.(gate|up)_proj\.weight$", 0, "intermediate", "one"),
        (r"\.feed_forward\.down_proj\.weight$", 1, "intermediate", "one"),
        (r"\.feed_forward\.experts\.down_proj$", 1, "moe_intermediate", "one"),
    )
    # Checkpoint tensors that hold several of the above stacked along one dim (Phi-3's;
    # transformers 5's experts [E, 2 I, H]): each part's slice, at its offset in the tensor.
    _FUSED = (
        (r"\.linear_attn\.(in_proj_qkv|conv1d)\.weight$", 0,
         (("lin_k_heads", "lin_dk", "total_lin_k_heads"),
          ("lin_k_heads", "lin_dk", "total_lin_k_heads"),
          ("lin_v_heads", "lin_dv", "total_lin_v_heads"))),
        (r"\.self_attn\.qkv_proj\.(weight|bias)$", 0,
         (("q_heads", "head", "total_heads"), ("kv_heads", "head", "total_kv_heads"),
          ("kv_heads", "head", "total_kv_heads"))),
        (r"\.mlp\.gate_up_proj\.weight$", 0,
         (("intermediate", "one", "total_intermediate"),
          ("intermediate", "one", "total_intermediate"))),
        (r"\.(mlp|block_sparse_moe|layers\.\d+)\.experts\.gate_up_proj$", 1,
         (("moe_intermediate", "one", "total_moe_intermediate"),
          ("moe_intermediate", "one", "total_moe_intermediate"))),
        (r"\.mlp\.experts\.gate_up_proj_bias$", 1,  # llama.cpp's fused gpt-oss [E, 2 I]
         (("moe_intermediate", "one", "total_moe_intermediate"),
          ("moe_intermediate", "one", "total_moe_intermediate"))),
        (r"\.block_sparse_moe\.input_linear\.weight$", 1,  # Granite MoE's [E, 2 I, H]
         (("moe_intermediate", "one", "total_moe_intermediate"),
          ("moe_intermediate", "one", "total_moe_intermediate"))),
        (r"\.feed_forward\.experts\.gate_up_proj$", 2,  # Llama 4's [E, H, 2 I]
         (("moe_intermediate", "one", "total_moe_intermediate"),
          ("moe_intermediate", "one", "total_moe_intermediate"))),
    )

    _UNITS = {"head": lambda p: p.head_dim, "v_head": lambda p: p.v_head_dim,
              "qkv_head": lambda p: 3 * p.head_dim, "pair": lambda p: 2,
              "qgate_head": lambda p: 2 * p.head_dim,
              "lin_dk": lambda p: p.lin_dk, "lin_dv": lambda p: p.lin_dv,
              "qkvz_group": lambda p: 2 * p.lin_dk + 2 * p._lin_ratio * p.lin_dv,
              "ba_group": lambda p: 2 * p._lin_ratio,
              "kv_b_head": lambda p: p.kv_b_head, "one": lambda p: 1}

    @property
    def _lin_ratio(self) -> int:
        return self.total_lin_v_heads // self.total_lin_k_heads

    def slice_of(self, hf_name: str, rules: tuple = ()) -> list[tuple[int, int, int]] | None:
        """The (dim, start, end) pieces of a checkpoint tensor this rank keeps, to be joined
        along dim in order (one piece, or one per part of a fused tensor); None: replicated.
        rules: a family's own (Family.hf_shard_rules), before the shared ones. A layer's
        tensor is sliced by its layer's plan."""
        if self.layer_plans and (m := _LAYER.search(hf_name)):
            return self.layer_plans[int(m.group(1))].slice_of(hf_name, rules)
        for pattern, dim, attr, unit in (*rules, *self._RULES):
            if re.search(pattern, hf_name):
                a, b = getattr(self, attr)
                scale = self._UNITS[unit](self)
                return [(dim, a * scale, b * scale)]
        for pattern, dim, parts in self._FUSED:
            if re.search(pattern, hf_name):
                pieces, offset = [], 0
                for attr, unit, total in parts:
                    a, b = getattr(self, attr)
                    scale = self._UNITS[unit](self)
                    pieces.append((dim, offset + a * scale, offset + b * scale))
                    offset += getattr(self, total) * scale
                return pieces
        return None


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _RowParallel:
    """A block whose output on this rank is a partial sum (its last matmul row-parallel):
    built with the block's own options, its output all-reduced over the ranks."""

    def __init__(self, group, **options):
        super().__init__(**options)
        self.tp_group = group

    def forward(self, *args, **kwargs):
        return self.tp_group.all_reduce(super().forward(*args, **kwargs))


class ParallelAttention(_RowParallel, Attention):
    """Attention over this rank's heads; o_proj's partial sums are all-reduced."""


class ParallelLatentAttention(_RowParallel, LatentAttention):
    """Latent attention over this rank's query heads (their rows of q_proj / q_b_proj and of
    kv_b_proj); the latent and its rope key are computed and cached whole on every rank (one
    row a token, shared by the heads); o_proj's partial sums are all-reduced."""


class WholeNorm(nn.Module):
    """An RMSNorm over a whole projection (OLMo 2's q and k norms) of which this rank holds
    some heads: its sum of squares all-reduced, the mean over the whole width."""

    def __init__(self, local: int, total: int, eps: float, group):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local))
        self.total, self.eps, self.tp_group = total, eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ss = self.tp_group.all_reduce(xf.pow(2).sum(-1, keepdim=True).contiguous())
        return (xf * torch.rsqrt(ss / self.total + self.eps) * self.weight.float()).to(x.dtype)


class ParallelGatedDeltaNet(_RowParallel, GatedDeltaNet):
    """A linear-attention layer over this rank's key heads and their value heads (their
    rows of every projection, convolution channels, gates and states); out_proj's partial
    sums are all-reduced."""


class ParallelGatedMLP(_RowParallel, GatedMLP):
    """The MLP over this rank's intermediate slice; down_proj's partial sums are all-reduced."""


class ParallelMLP(_RowParallel, MLP):
    """A non-gated MLP over this rank's slice of c_fc; c_proj's partial sums are all-reduced."""


class ParallelSparseMoE(_RowParallel, SparseMoE):
    """The experts over this rank's slice of each one's intermediate size (the router whole,
    so every rank picks the same experts); the partial sums are all-reduced."""


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_end) of the embedding; other tokens embed to zero here and
    are filled in by the all-reduce."""

    def __init__(self, vocab_start: int, vocab_end: int, hidden: int, group):
        super().__init__(vocab_end - vocab_start, hidden)
        self.vocab_start = vocab_start
        self.tp_group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp_group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


def _shard_attention(attn: nn.Module, plan: ShardPlan, group) -> nn.Module:
    """An attention block over this rank's heads (its sinks, and OLMo 2's whole-projection
    q / k norms, too)."""
    if isinstance(attn, LatentAttention):  # one latent, every rank's
        return ParallelLatentAttention(group, **{**attn.options, "num_heads": plan.num_heads})
    out = ParallelAttention(group, **{**attn.options, "num_heads": plan.num_heads,
                                      "num_kv_heads": plan.num_kv_heads})
    if getattr(attn, "sinks", None) is not None:  # gpt-oss: this rank's heads' sink logits
        out.sinks = nn.Parameter(torch.empty(plan.num_heads))
    if out.qk_norm_whole and out.q_norm is not None:  # OLMo 2
        out.q_norm = WholeNorm(out.q_size, plan.total_heads * out.head_dim, out.q_norm.eps,
                               group)
        out.k_norm = WholeNorm(out.kv_size, plan.total_kv_heads * out.head_dim,
                               out.k_norm.eps, group)
    return out


def _shard_deltanet(d: GatedDeltaNet, cfg: ModelConfig, plan: ShardPlan, group) -> nn.Module:
    """A gated DeltaNet over this rank's key heads and their value heads."""
    return ParallelGatedDeltaNet(
        group, hidden=cfg.hidden_size, num_k_heads=plan.lin_k_heads[1] - plan.lin_k_heads[0],
        num_v_heads=plan.lin_v_heads[1] - plan.lin_v_heads[0], head_k_dim=d.head_k_dim,
        head_v_dim=d.head_v_dim, conv_kernel=d.kernel, eps=d.eps)


def _shard_experts(moe: SparseMoE, plan: ShardPlan, group) -> nn.Module:
    """Routed experts over this rank's slice of each one's intermediate size."""
    return ParallelSparseMoE(group, **{**moe.options, "intermediate": plan.moe_intermediate_size,
                                       "shared_intermediate": plan.shared_intermediate_size})


def shard_model(model: nn.Module, plan: ShardPlan, group) -> nn.Module:
    """Swap `model`'s modules for this rank's 1/N versions, in place (call it on the meta
    device, before loading). model.config becomes the rank's local config."""
    cfg: ModelConfig = model.config
    model.family.require_tensor_parallel()
    device = next(model.parameters()).device
    with device:
        for i, layer in enumerate(model.layers):
            # The same blocks with the same options, on this rank's heads and slice.
            lp = plan.for_layer(i)
            if layer.linear:
                layer.linear_attn = _shard_deltanet(layer.linear_attn, cfg, plan, group)
            else:
                layer.self_attn = _shard_attention(layer.self_attn, lp, group)
            if isinstance(layer.mlp, MLP):
                layer.mlp = ParallelMLP(
                    group, **{**layer.mlp.options, "intermediate": lp.intermediate_size})
            elif isinstance(layer.mlp, SparseMoE):
                layer.mlp = _shard_experts(layer.mlp, plan, group)
            else:
                layer.mlp = ParallelGatedMLP(
                    group, **{**layer.mlp.options, "intermediate": lp.intermediate_size})
            if getattr(layer, "moe", None) is not None:  # Gemma 4's experts beside the MLP
                layer.moe.experts = _shard_experts(layer.moe.experts, plan, group)
        model.embed_tokens = VocabParallelEmbedding(*plan.vocab, cfg.hidden_size, group)
        model.lm_head = nn.Linear(cfg.hidden_size, plan.local_vocab, bias=cfg.lm_head_bias)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.config = plan.local_config(cfg)
    model.tp_plan = plan
    return model


class Shard:
    """What the loader needs to build one rank's part: swap modules, slice tensors."""

    def __init__(self, plan: ShardPlan, group):
        self.plan, self.group = plan, group

    def apply(self, model: nn.Module) -> nn.Module:
        return shard_model(model, self.plan, self.group)

    def slice_of(self, hf_name: str) -> list[tuple[int, int, int]] | None:
        return self.plan.slice_of(hf_name)

    def slicer(self, rules: tuple):
        """slice_of with a family's own rules first (an HF checkpoint's tensors laid out
        the family's way: Family.hf_shard_rules)."""
        return lambda hf_name: self.plan.slice_of(hf_name, rules)

    def finish(self, model: nn.Module) -> None:
        """After loading: a row-parallel layer's bias (o_proj's, the MLP's down projection's)
        is added once, by rank 0; the other ranks' copies are zeroed, so that the
        all-reduce of the partial sums adds it once."""
        if self.plan.rank == 0:
            return
        with torch.no_grad():
            for layer in model.layers:
                for linear in (getattr(getattr(layer, "self_attn", None), "o_proj", None),
                               getattr(layer.mlp, "c_proj", None),
                               getattr(layer.mlp, "down_proj", None)):
                    if getattr(linear, "bias", None) is not None:
                        linear.bias.zero_()
                if getattr(layer.mlp, "experts_down_bias", None) is not None:  # gpt-oss
                    layer.mlp.experts_down_bias.zero_()
