"""The generic decoder every family runs: token ids -> hidden states over a paged KV cache.

Built from the shared blocks (layers.py: attention with its options, the gated MLP, RMSNorm,
rotary tables; moe.py: routed experts) as a ModelConfig says; the family (family.py) only
names checkpoints' tensors and reads its config keys. One layer is

    x = x + [attn_out_norm](attention(input_layernorm(x))) [* residual_scale]
    x = x + [mlp_out_norm](mlp(post_attention_layernorm(x))) [* residual_scale]

or, a parallel block (Phi-2), x = x + attention(input_layernorm(x)) + mlp(input_layernorm(x))
(GPT-NeoX: the MLP's own post_attention_layernorm(x))

(the bracketed norms: Gemma's and GLM-4's sandwich; the scale: Granite's
residual_multiplier; OLMo 2 has the sandwich norms only, a NoNorm in place of the other
two; Gemma 4 may add routed experts beside the MLP, moe.ExpertsBesideMLP, then its
per-layer input, ple.py, and multiplies the stream by a scalar per layer), run in
residual-stream form: each layer returns its MLP output (delta) and the residual stream x,
and the next norm adds the delta into x in place before normalising it
(RMSNorm.add_forward: one C++ pass with the kernels, the same bits as x + delta then the
norm in the PyTorch reference); a Gemma 4 layer adds its own and returns no delta. Sliding
layers may take a second rotary table (of their own head size: Gemma 4's global layers
have a larger one, and their own KV-head count). Which implementation each op runs (C++ or
PyTorch) the op modules chose once (select_ops); the forward here is the same either way.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from servelm.models import decode_stack
from servelm.models.config import ModelConfig
from servelm.models.layers import (MLP, Attention, GatedMLP, NoNorm, RotaryEmbedding,
                                   make_norm, rotate_half_rows, select_ops)
from servelm.models.linear_attention import GatedDeltaNet
from servelm.models.mla import LatentAttention
from servelm.models.moe import ExpertsBesideMLP, SparseMoE, tune_fused_experts
from servelm.models.ple import PerLayerEmbedding, PerLayerInput
from servelm.quantization.mxfp4 import MXFP4Weight

if TYPE_CHECKING:
    from servelm.attention.metadata import ForwardBatch


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = cfg.norm_type
        # Llama 4's per-layer options (its family's extra): chunked local attention, q/k
        # L2 norms and the position scale of the queries on some layers only.
        extra = cfg.extra
        scaled = extra.get("query_scale_layers")  # None: every layer
        self.input_layernorm = make_norm(norm, h, eps) if cfg.pre_norms else NoNorm()
        mla = extra.get("mla")  # DeepSeek's latent attention (its family's options)
        # A linear-attention layer (Qwen3-Next, Qwen3.5): a gated DeltaNet over the
        # sequence's recurrent state (its state slot) in place of attention over the KV.
        self.linear = cfg.is_linear_layer(index)
        if self.linear:
            self.linear_attn = GatedDeltaNet(h, eps=eps, **extra["linear_attn"])
        elif mla:
            self.self_attn = LatentAttention(h, cfg.num_heads, scale=cfg.attn_scale,
                                             bias=cfg.attention_bias, **mla)
        else:
            self.self_attn = Attention(
                h, cfg.num_heads, cfg.kv_heads_of(index), cfg.head_dim_of(index),
                bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=eps,
                window=cfg.window(index), scale=cfg.attn_scale,
                rotary_dim=cfg.rotary_dim, softcap=cfg.attn_logit_softcap,
                rope=index not in cfg.no_rope_layers,
                qk_norm_whole=cfg.qk_norm_whole,
                out_bias=cfg.attention_out_bias,
                q_scale_beta=(cfg.query_scale_beta
                              if scaled is None or index in scaled else 0.0),
                q_scale_period=cfg.query_scale_period,
                q_scale_offset=extra.get("query_scale_offset", 0.0),
                chunk=(extra["attention_chunk_size"]
                       if index in extra.get("chunked_layers", ()) else None),
                qk_l2_norm=index in extra.get("qk_l2_norm_layers", ()),
                v_norm=bool(extra.get("v_norm")),
                k_eq_v=index in extra.get("k_eq_v_layers", ()),
                kv_shared=cfg.kv_source(index) != index,
                output_gate=bool(extra.get("attn_output_gate")))
        if cfg.extra.get("attention_sinks"):
            # A learned logit per query head in each query's softmax denominator (gpt-oss):
            # every attention backend runs it (AttentionSpec.sinks).
            self.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        self.parallel = cfg.parallel_block  # the MLP reads the input norm's output too
        self.post_attention_layernorm = (
            None if self.parallel and not cfg.parallel_mlp_norm
            else make_norm(norm, h, eps) if cfg.pre_norms else NoNorm())
        self.moe = None  # Gemma 4's experts beside the dense MLP
        if cfg.is_moe_layer(index) and extra.get("moe_beside_mlp"):
            self.mlp = GatedMLP(h, cfg.intermediate_of(index), cfg.hidden_act)
            self.moe = ExpertsBesideMLP(h, cfg.moe_intermediate_size, cfg.num_experts,
                                        cfg.num_experts_per_tok, cfg.hidden_act, eps)
        elif cfg.is_moe_layer(index):
            # gpt-oss's router and expert biases and clamped SwiGLU, Llama 4's sigmoid router,
            # input-weighted experts and ungated shared expert: their families' extra options.
            moe_options = {k: cfg.extra[k] for k in ("router_bias", "expert_bias",
                                                     "swiglu_limit", "swiglu_alpha",
                                                     "router_scoring", "expert_input_weighted",
                                                     "shared_expert_gate", "routed_scaling",
                                                     "n_group", "topk_group", "score_bias")
                           if k in cfg.extra}
            self.mlp = SparseMoE(h, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act,
                                 cfg.shared_expert_intermediate_size, **moe_options)
        elif cfg.mlp_gated:
            self.mlp = GatedMLP(h, cfg.intermediate_of(index), cfg.hidden_act)
        else:
            self.mlp = MLP(h, cfg.intermediate_of(index), cfg.hidden_act, cfg.mlp_bias)
        self.attn_out_norm = make_norm(norm, h, eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = make_norm(norm, h, eps) if cfg.sandwich_norms else None
        self.residual_scale = cfg.residual_scale  # each branch's output times this (Granite)
        # Which rotary table the layer takes: sliding layers their own base, where it differs.
        self.local_rotary = cfg.window(index) is not None and cfg.rope_local_theta is not None
        # Its block group where the pool keeps a hybrid model's layers in groups
        # (ModelConfig.kv_groups, set by the runner: set_kv_groups): whose pages it reads.
        self.kv_group = 0
        # Gemma 4: the per-layer input added at the end (ple.py), then the whole residual
        # stream times layer_scalar; such a layer adds its own MLP output and returns no delta.
        size = extra.get("per_layer_input_size")
        self.per_layer_input = PerLayerInput(h, size, cfg.hidden_act, eps) if size else None
        self.layer_scalar = nn.Parameter(torch.ones(1)) if extra.get("layer_scalar") else None
        self.closes_stream = self.per_layer_input is not None or self.layer_scalar is not None

    def forward(self, delta, residual, cos, sin, batch, kv_cache, rows=None,
                per_layer_input=None):
        """residual += delta (the previous layer's MLP output, None for the first layer or
        after a layer that adds its own) inside the input norm; returns (this layer's MLP
        output, residual), residual updated in place. rows: only these flat tokens continue
        past attention (the last layer, when only the sampled tokens' hidden states are
        wanted; the residual's rows are taken first); every token's K/V is still written.
        per_layer_input: this layer's [T, P] (Gemma 4's, ple.py)."""
        if delta is None:
            h = self.input_layernorm(residual)
        else:
            h = self.input_layernorm.add_forward(delta, residual)
        mixer = self.linear_attn if self.linear else self.self_attn
        a = mixer(h, cos, sin, batch, kv_cache, rows=rows)
        if self.parallel:
            if rows is not None:
                residual, h = residual[rows], h[rows]
            if self.post_attention_layernorm is not None:
                h = self.post_attention_layernorm(residual)
            return a + self.mlp(h), residual
        if rows is not None:
            residual = residual[rows]
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)
        if self.residual_scale != 1.0:
            a = a * self.residual_scale
        h = self.post_attention_layernorm.add_forward(a, residual)
        m = self.mlp(h)
        if self.moe is not None:  # the experts read the stream before the MLP's norm
            m = self.moe(m, residual)
        if self.mlp_out_norm is not None:
            m = self.mlp_out_norm(m)
        if self.residual_scale != 1.0:
            m = m * self.residual_scale
        if not self.closes_stream:
            return m, residual
        residual.add_(m)
        if self.per_layer_input is not None:
            p = per_layer_input if rows is None else per_layer_input[rows]
            residual.add_(self.per_layer_input(residual, p))
        if self.layer_scalar is not None:
            residual.mul_(self.layer_scalar)
        return None, residual

    def linears(self) -> tuple[nn.Module, ...]:
        """qkv, o, gate_up, down and the attention's output gate where it has one; a
        linear-attention layer's in_proj_qkvz, out_proj, gate_up, down, in_proj_ba: the order
        the DecodeStack takes them. A layer whose MLP is routed experts has its shared
        expert's gate_up and down, or None for both."""
        mlp = self.mlp
        if getattr(mlp, "shared_expert", None) is not None:  # routed experts beside it
            mlp = mlp.shared_expert
        up, down = ((mlp.gate_up_proj, mlp.down_proj) if hasattr(mlp, "gate_up_proj")
                    else (mlp.c_fc, mlp.c_proj) if hasattr(mlp, "c_fc")  # a non-gated MLP's
                    else (None, None))  # routed experts alone: no MLP linears
        if self.linear:
            la = self.linear_attn
            return (la.in_proj_qkvz, la.out_proj, up, down, la.in_proj_ba)
        attn = self.self_attn
        gate = () if attn.attn_gate is None else (attn.attn_gate,)
        return (attn.qkv_proj, attn.o_proj, up, down, *gate)

    @property
    def window(self) -> int | None:
        """The layer's sliding window (None: full attention, or linear attention)."""
        return None if self.linear else self.self_attn.window

    def is_plain(self) -> bool:
        """Whether the DecodeStack can describe this layer (decode_stack.describe_layer);
        a layer it cannot runs per op."""
        return not isinstance(decode_stack.describe_layer(self), str)

    def decode_stack_args(self, rows: int = 1) -> tuple | None:
        """This layer's part of a DecodeStack for steps of `rows` rows (decode_stack.layer_args:
        weights, format codes, norms, qkv bias), or None where the stack cannot take it."""
        args = decode_stack.layer_args(self, rows)
        return None if isinstance(args, str) else args


class CausalLM(nn.Module):
    """Token ids -> hidden states over a paged KV cache; logits only where asked."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        from servelm.models.registry import family_for_architecture

        self.config = cfg
        self.family = family_for_architecture(cfg.architecture)
        self.max_positions = max_positions
        # Given its (empty) weight, the embedding skips a random init the checkpoint
        # overwrites, and with it torch's one-time import of torch._dynamo (~3 s here).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        size = cfg.extra.get("per_layer_input_size")  # Gemma 4's per-layer inputs (ple.py)
        self.per_layer_embed = (PerLayerEmbedding(cfg.extra["per_layer_vocab_size"],
                                                  cfg.hidden_size, cfg.num_layers, size,
                                                  cfg.rms_norm_eps) if size else None)
        self.norm = make_norm(cfg.norm_type, cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.rotary_local = None
        if torch.get_default_device().type != "meta":  # else build_model makes them later:
            self.init_rotary()  # arithmetic on meta tensors imports torch._dynamo (~3 s)
        # Always a module, so quantisation and tensor parallelism can swap it like any other
        # linear layer; tied checkpoints share the embedding's parameter.
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode = False  # set by bind_decode_layers
        self.stack_needs_positions = False  # (decode_stack.bind: a stack scales queries)
        self._decode_stacks: list = []  # (first row count, last, DecodeStack)
        self._decode_kv = None

    def select_ops(self, kernels: bool) -> None:
        """Every op module's implementation, chosen once the weights are final (the
        ModelRunner's, before it pins the modules): servelm's C++ ops, or the PyTorch
        references. The DecodeStacks bind_decode_layers binds run only beside the C++ ops
        (they are the same arithmetic), so the references turn them off and the C++ ops
        back on."""
        select_ops(self, kernels)
        if kernels:  # the fused routed experts' weight order and token limit (MoE models)
            tune_fused_experts(self)
        self.fused_decode = kernels and bool(self._decode_stacks)

    def init_rotary(self, device: torch.device | None = None) -> None:
        """(Re)build the rotary tables (buffers not in any checkpoint) on `device`: the
        model's, and the sliding layers' own where their base differs (Gemma 3), each as
        wide as its layers' heads (Gemma 4's global layers have larger ones)."""
        cfg = self.config
        local = [i for i, layer in enumerate(self.layers) if layer.local_rotary]
        main = next((i for i in range(cfg.num_layers) if i not in local), 0)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim_of(main), self.max_positions,
                                      cfg.rope_theta, cfg.rope_scaling).to(device)
        self.rotary_local = None
        if local:
            self.rotary_local = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim_of(local[0]),
                                                self.max_positions, cfg.rope_local_theta,
                                                None).to(device)

    def decode_stack_supported(self) -> bool:
        """Whether the whole-step C++ executor can describe this model (decode_stack.describe;
        else the per-layer kernel path runs its decode steps)."""
        return not isinstance(decode_stack.describe(self), str)

    def set_kv_groups(self, groups) -> None:
        """Each layer's block group (a KVGroups: the pool keeps a hybrid model's layers in
        groups, each reading its group's pages; None: one group). Before the DecodeStacks
        are bound."""
        for i, layer in enumerate(self.layers):
            layer.kv_group = groups.place(i)[0] if groups is not None else 0

    def bind_decode_layers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Once the weights are final (quantised, on the CPU with the C++ kernels): bind every
        decoder layer and its KV cache (with the embedding, rotary tables and final norm) into
        `servelm_stack.DecodeStack`s, which then run decode-only bf16 batches from token ids
        to the final norm in one C++ call per step, bit-identical to the per-op kernel path
        (decode_stack.bind: one stack per run of row buckets on the same modules; a model or
        layer it cannot describe says why, once, and runs op by op). Only over an unquantised
        KV cache (kv_cache_dtype auto: it does not read scales). The runner binds it unless
        KernelConfig.fused_decode is off."""
        return decode_stack.bind(self, kv_caches)

    def decode_stack_ranges(self) -> list[tuple[int, int]]:
        """The row counts (first, last) of decode-only steps a DecodeStack runs, one range a
        stack."""
        return [(lo, hi) for lo, hi, _ in self._decode_stacks] if self.fused_decode else []

    def _stack_for(self, rows: int):
        for lo, hi, stack in self._decode_stacks:
            if lo <= rows <= hi:
                return stack
        return None

    def decode_stack_takes(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           rows: int) -> bool:
        """Whether a DecodeStack runs a decode-only step of `rows` rows over kv_caches (one
        is bound, to these caches, for that many rows)."""
        return (self.fused_decode and kv_caches is self._decode_kv
                and self._stack_for(rows) is not None)

    def decode_step(self, input_ids: list[int], positions: list[int], slots: list[int],
                    tables: list[int], context_lens: list[int],
                    states: tuple[list, list, list] | None = None) -> torch.Tensor:
        """A decode-only step that decode_stack_takes, from plain lists (as
        servelm.attention.metadata.decode_lists builds them): the final hidden states [M, hidden], the same
        bits as forward() on the equivalent batch. states: a model with linear-attention
        layers' (each row's state slot, fresh flag, snapshot row or -1)."""
        stack = self._stack_for(len(input_ids))
        if self.per_layer_embed is not None:  # Gemma 4's per-layer inputs
            decode_stack.set_per_layer_inputs(self, stack, torch.tensor(input_ids))
        if states is not None:
            decode_stack.set_state_rows(stack, *states)
        if "lora_step" in self.__dict__:  # adapters: the step's row slots (servelm.lora.wrap)
            decode_stack.set_lora_rows(self, stack)
        return stack.run_lists(input_ids, positions, slots, tables, context_lens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # the scale rounded to the weights' dtype, as HF does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                sampled_only: bool = False) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] of all scheduled tokens, or with
        sampled_only those of batch.logits_indices [S, hidden]: then the last layer's o_proj
        and MLP run for those rows only (prompt positions whose logits nobody reads skip
        1/num_layers of the prompt's matmuls)."""
        n, last = batch.input_ids.shape[0], len(self.layers) - 1
        rows = batch.logits_indices if sampled_only and batch.logits_indices.shape[0] < n else None
        # The DecodeStack takes a step of decodes only, as the cpu backend's ragged rows.
        dec = batch.attn.decodes
        # (A stack that scales queries needs the positions, which only run_tokens takes.)
        fused = (dec is not None and dec.num == n and self.decode_stack_takes(kv_caches, n)
                 and not (rows is not None and self.stack_needs_positions))
        rec = batch.recurrent  # linear attention: the stack takes decodes in row order only
        if fused and rec is not None:
            fused = rec.decodes_only
            if fused:
                decode_stack.set_state_rows(
                    self._stack_for(n), rec.slots, rec.fresh,
                    [s[1] if s else -1 for s in rec.snapshots] if rec.snapshots else None)
        if fused and "lora_step" in self.__dict__:  # adapters: the step's row slots
            # (a stack bound before the layers were wrapped has none: op by op then)
            fused = self.stack_runs_lora or self.lora_step.tokens is None
            if fused:
                decode_stack.set_lora_rows(self, self._stack_for(n))
        if fused:  # a hybrid model's block groups: each group's slots and tables
            slots, block_tables = batch.stack_inputs()
        if fused and rows is None:  # the whole step, embedding to final norm, in one call
            if self.per_layer_embed is not None:  # Gemma 4's per-layer inputs
                decode_stack.set_per_layer_inputs(self, self._stack_for(n), batch.input_ids)
            return self._stack_for(n).run_tokens(batch.input_ids, batch.positions, slots,
                                                 block_tables, dec.context_lens)
        # The residual stream x, updated in place by each norm's add.
        x = self.embed(batch.input_ids)
        # Gemma 4's per-layer inputs [T, layers, P], from the embedding before any layer.
        ple = None if self.per_layer_embed is None else self.per_layer_embed(batch.input_ids, x)
        tables = [self.rotary.cos_sin(batch.positions, x.dtype)]
        if self.rotary_local is not None:
            tables.append(self.rotary_local.cos_sin(batch.positions, x.dtype))
        if fused:
            if ple is not None:
                self._stack_for(n).set_per_layer_inputs(ple.contiguous())
            delta = self._stack_for(n).run_rotary(x, [t for cs in tables for t in cs],
                                                  slots, block_tables, dec.context_lens)
            if rows is not None:
                delta, x = delta[rows], x[rows]
        else:
            delta = None
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                cos, sin = tables[layer.local_rotary]
                delta, x = layer(delta, x, cos, sin, batch.for_group(layer.kv_group), kv,
                                 rows=rows if i == last else None,
                                 per_layer_input=None if ple is None else ple[:, i])
        return self.norm(x) if delta is None else self.norm.add_forward(delta, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> fp32 logits [S, vocab] (divided by logits_scaling, and
        soft-capped, where the family says)."""
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- loading ----------------------------------------------------------------------------

    # Fused parameters and the checkpoint names stacked into them, in row order.
    _STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # Experts: one tensor per expert (HF) or all experts in one (GGUF's *_exps).
    _EXPERT = re.compile(r"(.*\.mlp)\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj)"
                         r"\.(weight|bias)")
    _FUSED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)")
    _LAYER = re.compile(r"layers\.(\d+)\.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in (HF names, in the family's spelling); every parameter
        must be filled exactly once. A pairwise rotary's q/k rows (rope_interleaved) are
        reordered to the rotate-half layout on the way (layers.rotate_half_rows), and a
        fused qkv tensor laid out head by head (qkv_per_head) to q | k | v blocks."""
        if self.config.tie_word_embeddings:
            # Re-tie: moving the model off the meta device gives each module its own tensor.
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        experts: dict[str, set] = {}
        loaded: set[str] = set()
        stacks = {**self._STACKED, **self.family.stacked}
        for name, tensor in self._named(weights):
            if isinstance(tensor, MXFP4Weight):  # routed experts kept as MXFP4 (to_mxfp4)
                self._copy_mxfp4(name, tensor)
                continue
            if self.config.rope_interleaved and re.search(r"\.self_attn\.[qk]_proj\.", name):
                cfg = self.config
                tensor = rotate_half_rows(tensor, cfg.head_dim, cfg.rotary_dim or cfg.head_dim)
            if self.config.qkv_per_head and re.search(r"\.self_attn\.qkv_proj\.", name):
                # [heads, (q, k, v), d, ...] -> [(q, k, v), heads, d, ...]
                d = self.config.head_dim
                tensor = (tensor.reshape(-1, 3, d, *tensor.shape[1:]).transpose(0, 1)
                          .reshape(tensor.shape))
            fused_experts = self._FUSED_EXPERTS.fullmatch(name)
            if fused_experts:  # all experts in one tensor, as transformers 5 holds them
                prefix, part = fused_experts.groups()
                target = f"{prefix}.experts_{'down' if part == 'down_proj' else 'gate_up'}"
                self._copy(params, target, tensor)
                loaded.add(target)
                continue
            m = self._EXPERT.fullmatch(name)
            if m:
                self._copy_expert(params, m, tensor, experts, loaded)
                continue
            stacked = next(((fused, part) for fused, parts in stacks.items()
                            for part in parts if f".{part}." in name), None)
            if stacked is None:
                self._copy(params, name, tensor)
                loaded.add(name)
                continue
            fused, part = stacked
            target = name.replace(f".{part}.", f".{fused}.")
            pending.setdefault(target, {})[part] = tensor
            parts = stacks[fused]
            if fused == "qkv_proj":  # a layer may fuse fewer (Gemma 4's k_eq_v, KV-shared)
                parts = getattr(self._layer_of(target).self_attn, "qkv_parts", parts)
            if all(p in pending[target] for p in parts):
                got = pending.pop(target)
                self._copy(params, target, [got[p] for p in parts])
                loaded.add(target)
        missing = set(params) - loaded
        missing |= {f"{n}.experts" for n, m in self.named_modules()
                    if isinstance(m, SparseMoE) and m.expert_format == "mxfp4"
                    and not m.mxfp4_complete}
        if missing or pending:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:5]}")

    def _named(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint tensors as (decoder name, tensor), in the family's spelling and
        values; a tensor the family splits (Family.split) comes as its parts."""
        for hf_name, tensor in weights:
            name = self.family.internal_name(hf_name)
            if "rotary_emb" in name or self._not_read(name):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding serves as the head
            if isinstance(tensor, MXFP4Weight):
                yield name, self.family.transform_mxfp4(name, tensor)
                continue
            yield from self.family.split(name, self.family.transform(name, tensor), self.config)

    _LAYER = re.compile(r"layers\.(\d+)\.")
    _KV_PARTS = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")

    def _layer_of(self, name: str) -> DecoderLayer:
        return self.layers[int(self._LAYER.match(name).group(1))]

    def _not_read(self, name: str) -> bool:
        """A checkpoint tensor the model has no place for, by design: a KV-shared layer's
        own k / v projections and norms (Gemma 4's checkpoints may hold them; transformers
        ignores them too), and any of a layer after the decoder's (the multi-token-prediction
        layers DeepSeek-V3's and GLM-4.5's checkpoints hold, which transformers ignores)."""
        m = self._LAYER.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_layers:
            return True
        m = self._KV_PARTS.match(name)
        return m is not None and self.config.kv_source(int(m.group(1))) != int(m.group(1))

    def _copy_expert(self, params, m: re.Match, tensor: torch.Tensor, seen: dict[str, set],
                     loaded: set[str]) -> None:
        prefix, expert, part = m.group(1), m.group(2), m.group(3)
        name = f"{prefix}.experts_down" if part == "down_proj" else f"{prefix}.experts_gate_up"
        if m.group(4) == "bias":  # [E, 2 * I] / [E, hidden]: rows on the same dim as the weight's
            name += "_bias"
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {m.group(0)!r}")
        p = params[name]
        num, inter = p.shape[0], self.config.moe_intermediate_size
        rows = slice(None) if part == "down_proj" else (
            slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter))
        experts = range(num) if expert is None else [int(expert)]
        dst = p.data[:, rows] if expert is None else p.data[int(expert), rows]
        if expert is not None and int(expert) >= num:
            raise ValueError(f"checkpoint has an unexpected weight {m.group(0)!r}")
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {m.group(0)!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        got = seen.setdefault(name, set())
        got.update((e, part) for e in experts)
        if len(got) == num * (1 if part == "down_proj" else 2):
            loaded.add(name)

    def _copy_mxfp4(self, name: str, w: MXFP4Weight) -> None:
        """MXFP4 experts (all of a layer's, one projection or gate / up) into their
        SparseMoE, which to_mxfp4 readied for them."""
        fused, each = self._FUSED_EXPERTS.fullmatch(name), self._EXPERT.fullmatch(name)
        if fused:
            prefix, which, part = fused.group(1), fused.group(2).removesuffix("_proj"), "all"
        elif each and each.group(2) is None and each.group(4) == "weight":
            prefix, part = each.group(1), each.group(3).removesuffix("_proj")
            which, part = ("down", "all") if part == "down" else ("gate_up", part)
        elif name.endswith((".experts_gate_up", ".experts_down")):  # the layer's own (Gemma 4)
            prefix, _, attr = name.rpartition(".")
            which, part = attr.removeprefix("experts_"), "all"
        else:
            raise ValueError(f"MXFP4 weight {name!r}: servelm keeps only a layer's stacked "
                             f"routed experts in MXFP4")
        moe = self.get_submodule(prefix)
        if not isinstance(moe, SparseMoE) or moe.expert_format != "mxfp4":
            raise ValueError(f"MXFP4 weight {name!r} has no MXFP4 experts to fill")
        moe.load_mxfp4(which, part, w)

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str,
              tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Copy tensor into the parameter; a list of tensors: stacked along the rows, each
        copied into its own rows (no concatenated temporary of the whole)."""
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight {name!r}")
        p = params[name]
        if not isinstance(tensor, list):
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            return
        shape = (sum(t.shape[0] for t in tensor), *tensor[0].shape[1:])
        if tuple(p.shape) != shape or any(t.shape[1:] != tensor[0].shape[1:] for t in tensor):
            got = " + ".join(str(tuple(t.shape)) for t in tensor)
            raise ValueError(f"weight {name!r} has shape {got}, expected {tuple(p.shape)}")
        with torch.no_grad():
            row = 0
            for t in tensor:
                p[row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
