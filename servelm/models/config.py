"""ModelConfig: one normalised description of a model, from GGUF metadata or HF config.json.

The fields common to every family are read here; each family (servelm/models/families/)
adds what only it has (q/k norms, sandwich norms, sliding windows, experts...) through its
`hf_config` / `gguf_config` hooks, so this file knows no family by name."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

# The config keys the families read too, below this module and the registry.
from servelm.models.hf_keys import (FULL, LINEAR, SLIDING, hf_layer_types,  # noqa: F401
                                    rope_scaling, rope_theta)

# The poolings servelm runs: the last token's final hidden state, the mean over the prompt,
# or the first token's (CLS).
POOLING_TYPES = ("last", "mean", "cls")
# llama.cpp's enum llama_pooling_type, as GGUF's <arch>.pooling_type holds it.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' 1_Pooling/config.json flags -> servelm's pooling.
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
               "pooling_mode_weightedmean_tokens": "weightedmean"}


# Block groups past this cost more bookkeeping a step than the pages they free save.
MAX_KV_GROUPS = 16


@dataclass(frozen=True)
class KVGroups:
    """A hybrid model's cache layers in groups (ModelConfig.kv_groups): a block id names a
    page of one group, every page the same bytes, and a page holds K and V of block_size
    tokens in each of its group's layers (engine.model_runner.KVCache). Each group's
    layers read and write the pages of that group's block table; a KV-shared layer reads
    its source layer's (place)."""

    layers: tuple[tuple[int, ...], ...]  # each group's layers; group 0's are full attention
    reaches: tuple[int, ...]             # each group's reach (0: full attention)
    # Each group's layers in the order they fill a page: every layer's, or a KV-shared
    # layer's source (ModelConfig.kv_source), so place finds the pages it reads.
    sources: tuple[int, ...] = ()

    def place(self, layer: int) -> tuple[int, int]:
        """(group, position in the group) of a layer, or of its source if it shares KV."""
        src = self.sources[layer] if self.sources else layer
        for g, members in enumerate(self.layers):
            if src in members:
                return g, members.index(src)
        raise KeyError(f"layer {layer} is in no group")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, whatever file format they came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    family: str = "llama"
    # ---- the shared blocks' options (defaults: Llama) ----
    hidden_act: str = "silu"              # the MLP's activation: silu | gelu_tanh | gelu
    mlp_gated: bool = True                # act(gate) * up; False: act(up) alone (Starcoder2)
    mlp_bias: bool = False                # the MLP's linear layers have biases (Starcoder2)
    attention_out_bias: bool = False      # o_proj has a bias (Starcoder2)
    norm_type: str = "rms"                # rms | layer (LayerNorm with a bias: Starcoder2)
                                          # | layer_no_bias (Cohere)
    qk_norm: bool = False                 # RMSNorm over each head's q and k (Qwen3, Gemma 3)
    qk_norm_whole: bool = False           # ... over all of q and of k instead (OLMo 2)
    sandwich_norms: bool = False          # norms after attention and after the MLP (Gemma)
    pre_norms: bool = True                # False: no norms before them (OLMo 2: sandwich only)
    # Attention and MLP both read the input norm's output and are added together
    # (x + attn(ln(x)) + mlp(ln(x)): Phi-2, StableLM's use_parallel_residual).
    parallel_block: bool = False
    parallel_mlp_norm: bool = False       # ... the MLP on a norm of its own (GPT-NeoX)
    # The fused qkv checkpoint tensor holds each head's q, k and v together (GPT-NeoX's
    # query_key_value); reordered at load to the decoder's q | k | v blocks.
    qkv_per_head: bool = False
    lm_head_bias: bool = False            # the LM head has a bias (Phi-2)
    embed_scale: float = 1.0              # embeddings multiplied by this (Gemma: sqrt(hidden))
    residual_scale: float = 1.0           # attention and MLP outputs multiplied by this (Granite)
    logits_scaling: float = 1.0           # logits divided by this (Granite)
    attn_scale: float | None = None       # softmax scale; None: head_dim ** -0.5
    rotary_dim: int | None = None         # partial rotary (Phi-3.5/4): the first dims only
    # Rotary over adjacent pairs of dims (GPT-J style, GLM-4), not the two halves: q and k
    # rows are reordered at load so the rotate-half rotary computes the same scores.
    rope_interleaved: bool = False
    sliding_window: int | None = None     # keys a sliding layer sees, itself included
    # Per layer FULL | SLIDING | LINEAR; () = every layer FULL. A LINEAR layer is a gated
    # DeltaNet (models/linear_attention.py) with the options in extra["linear_attn"].
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # sliding layers' rotary base (Gemma 3)
    # Queries scaled by 1 + beta * ln(1 + floor(position / period)) after the rotary
    # (Llama 4's attention temperature, Ministral 3's llama_4_scaling_beta); 0: none.
    query_scale_beta: float = 0.0
    query_scale_period: int = 0
    no_rope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2/3)
    attn_logit_softcap: float | None = None   # the same on attention scores (Gemma 2)
    # ---- the paged KV cache's rows, where they are not the attention's own K and V ----
    # (None: num_kv_heads x head_dim, K and V apart.) DeepSeek's latent cache (models/mla.py):
    # one row of kv_lora_rank + qk_rope_head_dim per token and layer, attended as a single
    # KV head whose values are read from the same rows (cache_planes 1: V is not stored).
    cache_kv_heads: int | None = None
    cache_head_dim: int | None = None
    cache_planes: int = 2                 # 2: K and V stored apart; 1: V read from K's rows
    # ---- mixture of experts (0 experts: a dense model) ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True           # renormalise the chosen experts' weights
    dense_layers: tuple[int, ...] = ()    # layers with a dense MLP in a MoE model
    # A shared expert beside the routed ones in every MoE layer, its output gated by
    # sigmoid(shared_expert_gate(x)) (Qwen2-MoE); 0: none.
    shared_expert_intermediate_size: int = 0
    # ---- attention shapes per layer (Gemma 4's global layers); () = head_dim and
    # num_kv_heads on every layer ----
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # The layer whose K/V each layer attends (Gemma 4's num_kv_shared_layers: the last
    # layers read an earlier layer's cache and hold none of their own); () = its own.
    kv_source_layers: tuple[int, ...] = ()
    # ---- pooling (embeddings), as the checkpoint states it; None: it says nothing ----
    pooling_type: str | None = None       # last | mean | cls (or one servelm cannot run)
    pooling_normalize: bool | None = None  # sentence-transformers' Normalize module
    # Matryoshka: the checkpoint says its leading dimensions are an embedding of their own
    # (None: it does not; (): any count; else the counts it was trained for).
    matryoshka_dimensions: tuple[int, ...] | None = None
    pooling_unsupported: str | None = None  # why its stated pooling cannot be run here
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        bad = set(self.layer_types) - {FULL, SLIDING, LINEAR}
        if bad:
            raise ValueError(f"unsupported layer types {sorted(bad)} "
                             f"(supported: {FULL}, {SLIDING}, {LINEAR})")
        if LINEAR in self.layer_types and not self.extra.get("linear_attn"):
            raise ValueError("linear-attention layers need their options (extra['linear_attn'])")
        if self.layer_types and all(t == LINEAR for t in self.layer_types):
            raise ValueError("a model needs at least one attention layer")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding-attention layers need a sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh", "gelu"):
            raise ValueError(f"unsupported activation {self.hidden_act!r} "
                             f"(supported: silu, gelu_tanh, gelu)")
        if self.qkv_per_head and self.num_heads != self.num_kv_heads:
            raise ValueError("qkv_per_head needs as many KV heads as query heads")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim]")
        if self.norm_type not in ("rms", "layer", "layer_no_bias"):
            raise ValueError(f"unsupported norm_type {self.norm_type!r} "
                             f"(supported: rms, layer, layer_no_bias)")
        if self.mlp_bias and self.mlp_gated:
            raise ValueError("a gated MLP with biases is not supported")
        if self.parallel_block and (self.sandwich_norms or not self.pre_norms
                                    or self.residual_scale != 1.0):
            raise ValueError("a parallel block takes neither sandwich norms nor a residual scale")
        if self.query_scale_beta and self.query_scale_period <= 0:
            raise ValueError("query_scale_beta needs a positive query_scale_period")
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole needs qk_norm")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("a model without pre-norms needs the sandwich norms")
        if not self.logits_scaling:
            raise ValueError("logits_scaling must not be 0")
        for cap in ("final_logit_softcap", "attn_logit_softcap"):
            if getattr(self, cap) is not None and not getattr(self, cap) > 0:
                raise ValueError(f"{cap} {getattr(self, cap)} must be positive")
        for key in ("layer_head_dims", "layer_kv_heads", "kv_source_layers"):
            if getattr(self, key) and len(getattr(self, key)) != self.num_layers:
                raise ValueError(f"{key} has {len(getattr(self, key))} entries for "
                                 f"{self.num_layers} layers")
        for i in range(self.num_layers):
            if self.num_heads % self.kv_heads_of(i):
                raise ValueError(f"layer {i}: num_heads ({self.num_heads}) must be a multiple "
                                 f"of its {self.kv_heads_of(i)} KV heads")
            src = self.kv_source(i)
            if src != i and not (0 <= src < i and self.kv_source(src) == src):
                raise ValueError(f"layer {i} reads layer {src}'s KV cache, which is not an "
                                 f"earlier layer's own")
            if src != i and (self.head_dim_of(i), self.kv_heads_of(i)) != (
                    self.head_dim_of(src), self.kv_heads_of(src)):
                raise ValueError(f"layer {i} reads layer {src}'s KV cache of another shape")
        planes, cache_heads, _ = self.cache_layout
        if planes not in (1, 2) or self.num_heads % cache_heads:
            raise ValueError(f"the cache's layout ({planes} planes, {cache_heads} KV heads) "
                             f"must have 1 or 2 planes and divide the {self.num_heads} heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """What the paged cache holds per token and layer, and what the attention backends
        see: (planes: 2 for K and V, 1 where V is read from K's rows; KV heads; head dim)."""
        return (self.cache_planes, self.cache_kv_heads or self.num_kv_heads,
                self.cache_head_dim or self.head_dim)

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def layer_reach(self, layer: int) -> int | None:
        """How far back this attention layer's queries read keys: its sliding window or its
        attention chunk (a chunk of c positions starts less than c before its query), the
        smaller where it has both; None: its whole sequence."""
        chunk = (self.extra.get("attention_chunk_size")
                 if layer in self.extra.get("chunked_layers", ()) else None)
        spans = [s for s in (self.window(layer), chunk) if s]
        return min(spans) if spans else None

    @property
    def attention_reach(self) -> int | None:
        """How far back any query reads keys: the widest layer_reach over the attention
        layers, or None when some attention layer reads its whole sequence. KV blocks
        wholly this far behind a sequence's next token are never read again."""
        reach = 0
        for i in range(self.num_layers):
            if self.is_linear_layer(i):
                continue
            r = self.layer_reach(i)
            if r is None:
                return None
            reach = max(reach, r)
        return reach or None

    @property
    def kv_groups(self) -> KVGroups | None:
        """A hybrid model's cache layers in groups for the block manager's block groups:
        its full-attention layers, then its windowed ones (sliding window or attention
        chunk), each kind cut, in layer order, into groups whose K and V fill at most a
        page: the smaller kind's whole (at least the largest layer). Layers of one shape
        thus go in groups of the smaller kind's count; Gemma 4's global layers, twice as
        wide as its sliding ones, fill a page with half as many. Group 0 holds full-attention
        layers; a KV-shared layer reads its source's group. None where it does not apply:
        every layer full, every layer windowed (one reach serves all: BlockManager.reach),
        linear-attention layers, a KV-shared layer whose reach is not its source's, or more
        than MAX_KV_GROUPS groups."""
        n = self.num_layers
        if self.has_recurrent_state or any(self.layer_reach(i) != self.layer_reach(self.kv_source(i))
                                           for i in range(n)):
            return None
        own = self.kv_layers
        width = {i: self.cache_planes * math.prod(self.cache_shape_of(i)) for i in own}
        full = [i for i in own if self.layer_reach(i) is None]
        windowed = [i for i in own if self.layer_reach(i) is not None]
        if not full or not windowed:
            return None
        page = max(min(sum(width[i] for i in full), sum(width[i] for i in windowed)),
                   max(width.values()))
        groups: list[tuple[int, ...]] = []
        for kind in (full, windowed):
            group, filled = [], 0
            for i in kind:
                if group and filled + width[i] > page:
                    groups.append(tuple(group))
                    group, filled = [], 0
                group.append(i)
                filled += width[i]
            groups.append(tuple(group))
        if len(groups) > MAX_KV_GROUPS:
            return None
        reach = max(self.layer_reach(i) for i in windowed)
        sources = tuple(self.kv_source(i) for i in range(n)) if self.kv_source_layers else ()
        return KVGroups(tuple(groups), tuple(0 if g[0] in full else reach for g in groups),
                        sources)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether the layer is linear attention (a recurrent state, no KV cache)."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K and V of their own in the paged cache (not linear
        attention's, not a KV-shared layer's)."""
        return tuple(i for i in range(self.num_layers)
                     if not self.is_linear_layer(i) and self.kv_source(i) == i)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some layer keeps a recurrent state per sequence."""
        return LINEAR in self.layer_types

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers (a recurrent state each, no KV cache)."""
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    @property
    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state in one linear-attention layer: the convolution's last
        inputs [conv_dim (q, k and v), kernel - 1] and the delta rule's matrices [v_heads,
        k_dim, v_dim] (models/linear_attention.py)."""
        lin = self.extra["linear_attn"]
        conv = 2 * lin["num_k_heads"] * lin["head_k_dim"] + lin["num_v_heads"] * lin["head_v_dim"]
        return ((conv, lin["conv_kernel"] - 1),
                (lin["num_v_heads"], lin["head_k_dim"], lin["head_v_dim"]))

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def cache_shape_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of the layer's rows in the paged cache: its attention's,
        or the cache layout's where that differs (DeepSeek's latent rows)."""
        return (self.cache_kv_heads or self.kv_heads_of(layer),
                self.cache_head_dim or self.head_dim_of(layer))

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache this layer attends (itself, unless KV-shared)."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    @property
    def uniform_kv(self) -> bool:
        """Every layer holds its own K/V of one shape (num_kv_heads x head_dim)."""
        return all(self.kv_source(i) == i and self.head_dim_of(i) == self.head_dim
                   and self.kv_heads_of(i) == self.num_kv_heads for i in range(self.num_layers))

    def intermediate_of(self, layer: int) -> int:
        """The dense MLP's width on this layer (Gemma 4 doubles some: extra's
        intermediate_sizes)."""
        sizes = self.extra.get("intermediate_sizes")
        return sizes[layer] if sizes else self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def _mlp_params(self, layer: int, active: bool) -> int:
        h = self.hidden_size
        dense = (3 if self.mlp_gated else 2) * h * self.intermediate_of(layer)
        if not self.is_moe_layer(layer):
            return dense
        if self.extra.get("moe_beside_mlp"):  # Gemma 4: the experts beside the dense MLP
            experts = self.num_experts_per_tok if active else self.num_experts
            # + the router (its input scale, its per-expert scale) and the block's 3 norms
            return (dense + experts * 3 * h * self.moe_intermediate_size
                    + (h + 1) * self.num_experts + 4 * h)
        experts = self.num_experts_per_tok if active else self.num_experts
        shared_i = self.shared_expert_intermediate_size
        gate = h if self.extra.get("shared_expert_gate", True) else 0  # Qwen2-MoE's sigmoid gate
        shared = 3 * h * shared_i + gate if shared_i else 0
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts + shared

    def _attn_params(self, layer: int) -> int:
        """q, k, v, o and the q/k norms of one layer (a KV-shared layer has no k and v, a
        Gemma 4 k_eq_v layer no v)."""
        h, d = self.hidden_size, self.head_dim_of(layer)
        q, kv = self.num_heads * d, self.kv_heads_of(layer) * d
        kvs = (0 if self.kv_source(layer) != layer
               else 1 if layer in self.extra.get("k_eq_v_layers", ()) else 2)
        norms = 0
        if self.qk_norm:
            norms = q + kv if self.qk_norm_whole else (2 if kvs else 1) * d
        gate = h * q if self.extra.get("attn_output_gate") else 0  # Qwen3-Next's output gate
        return h * (q + kvs * kv) + q * h + norms + gate

    def _params(self, active: bool) -> int:
        h = self.hidden_size
        pre = (1 if self.parallel_block and not self.parallel_mlp_norm else 2) if self.pre_norms else 0
        norms = ((2 if self.sandwich_norms else 0) + pre) * h
        mla = self.extra.get("mla")
        if mla:  # DeepSeek's latent attention (models/mla.py)
            qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
            r, heads, c = mla["q_lora_rank"], self.num_heads, mla["kv_lora_rank"]
            query = h * heads * qk if r is None else h * r + r + r * heads * qk
            attn = (query + h * (c + mla["qk_rope_head_dim"]) + c
                    + c * heads * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
                    + heads * mla["v_head_dim"] * h)
        linear = 0
        if self.has_recurrent_state:  # a gated DeltaNet layer (models/linear_attention.py)
            (conv, k1), (hv, _, dv) = self.linear_state_shapes
            vd = hv * dv  # in_proj_qkvz: q, k, v (the conv's channels) and z; in_proj_ba
            linear = (h * (conv + vd) + h * 2 * hv + conv * (k1 + 1) + 2 * hv + dv + vd * h)
        layers = sum((linear if self.is_linear_layer(i) else attn if mla
                      else self._attn_params(i)) + self._mlp_params(i, active)
                     + norms for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        p = self.extra.get("per_layer_input_size")
        if p:  # Gemma 4's per-layer inputs: the table, the projection and norm, each layer's
            n = self.num_layers
            embed += self.extra["per_layer_vocab_size"] * n * p + h * n * p + p
            layers += n * (2 * h * p + h)
        return layers + embed + h

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; every expert)."""
        return self._params(active=False)

    @property
    def lookup_params(self) -> int:
        """Parameters besides the input embedding that a token only indexes (a row each):
        Gemma 4's per-layer embedding table (within num_params; 0 elsewhere)."""
        p = self.extra.get("per_layer_input_size")
        return self.extra["per_layer_vocab_size"] * self.num_layers * p if p else 0

    @property
    def expert_params(self) -> int:
        """The routed experts' weights (within num_params; 0 dense)."""
        per = 3 * self.hidden_size * self.moe_intermediate_size * self.num_experts
        return sum(per for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads: a MoE layer's chosen experts only (= num_params dense)."""
        return self._params(active=True)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        from servelm.models.registry import family_for_architecture

        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        family = family_for_architecture(archs[0])
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        base = dict(
            architecture=archs[0],
            family=family.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 0),  # (none: MoE only)
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta(cfg),
            rope_scaling=rope_scaling(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
        base.update(family.hf_config(cfg, base))
        # A soft-cap the family does not read would be dropped silently: refuse it.
        for key, field_ in (("attn_logit_softcapping", "attn_logit_softcap"),):
            if cfg.get(key) is not None and field_ not in base:
                raise ValueError(f"{key}={cfg[key]} is not supported for {archs[0]}")
        if cfg.get("matryoshka_dimensions"):
            base["matryoshka_dimensions"] = tuple(int(d) for d in cfg["matryoshka_dimensions"])
        elif cfg.get("is_matryoshka"):
            base["matryoshka_dimensions"] = ()
        return cls(**base)

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = cls.from_hf_dict(json.load(f))
        pooling = sentence_transformers_pooling(path)
        return replace(cfg, **pooling) if pooling else cfg

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """meta: GGUF key -> value (scalars, strings, lists)."""
        from servelm.models.registry import family_for_gguf

        arch = meta["general.architecture"]
        family = family_for_gguf(arch)

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {"rope_type": get("rope.scaling.type"),
                       "factor": float(get("rope.scaling.factor", 1.0)),
                       "original_max_position_embeddings":
                           int(get("rope.scaling.original_context_length", 0))}
        if scaling and scaling["rope_type"] not in ("linear", "yarn"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling['rope_type']!r} "
                             f"(supported: linear, yarn)")
        base = dict(
            architecture=family.architectures[0],
            family=family.name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            # (a list: one a layer, Gemma 4's; the family reads it whole)
            intermediate_size=int(_first(get("feed_forward_length", 0))),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_first(get("attention.head_count_kv", num_heads))),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
        )
        if get("expert_count"):
            n = base["num_layers"]
            base.update(num_experts=int(get("expert_count")),
                        num_experts_per_tok=int(get("expert_used_count")),
                        moe_intermediate_size=int(get("expert_feed_forward_length", 0)
                                                  or get("feed_forward_length")),
                        # layers without a router are dense (Qwen3-MoE's mlp_only_layers)
                        dense_layers=tuple(i for i in range(n)
                                           if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))
        rot = get("rope.dimension_count")
        if rot and int(rot) != base["head_dim"]:
            base["rotary_dim"] = int(rot)
        local = get("rope.freq_base_swa")  # the sliding layers' own base, where written
        if local is not None:
            base["rope_local_theta"] = float(local)
        base.update(family.gguf_config(get, base, tensor_names))
        pooling = get("pooling_type")
        if pooling is not None and int(pooling) != 0:  # 0: none stated
            kind = _GGUF_POOLING.get(int(pooling), f"type {int(pooling)}")
            base["pooling_type"] = kind
            if kind not in POOLING_TYPES:
                base["pooling_unsupported"] = f"the GGUF's pooling_type is {kind}"
        return cls(**base)


def _first(value):
    """A GGUF key that may hold one value or one a layer: the first."""
    return value[0] if isinstance(value, (list, tuple)) else value


def sentence_transformers_pooling(path: str) -> dict[str, Any]:
    """ModelConfig's pooling fields from a sentence-transformers checkpoint's modules.json
    (its Pooling module's config.json, whether a Normalize module follows; {} without one).
    Modules servelm does not apply (a Dense projection, a pooling other than last, mean or
    CLS, several at once) are named in pooling_unsupported rather than run wrongly."""
    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {"pooling_normalize": False}
    problems = []
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            out["pooling_normalize"] = True
        elif kind == "Pooling":
            try:
                with open(os.path.join(path, m.get("path", ""), "config.json")) as f:
                    flags = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                problems.append(f"its Pooling config cannot be read ({e})")
                continue
            modes = [v for k, v in _ST_POOLING.items() if flags.get(k)]
            if len(modes) != 1:
                problems.append(f"its Pooling module combines {modes or 'no'} modes")
            else:
                out["pooling_type"] = modes[0]
                if modes[0] not in POOLING_TYPES:
                    problems.append(f"its Pooling module pools by {modes[0]}")
        elif kind != "Transformer":
            problems.append(f"it has a {kind} module, which servelm does not apply")
    if problems:
        out["pooling_unsupported"] = "; ".join(problems)
    return out
