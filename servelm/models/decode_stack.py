"""The whole-step decoder: a model's decoder layers bound into C++ DecodeStacks
(servelm/kernels/csrc/decode_stack.cpp, `torch.classes.servelm_stack.DecodeStack`), which run
a decode-only step from token ids to the final norm in one call.

The stack runs any layer it can be told about: the model describes its layers here
(`describe`: a StackDescription, the layer options the C++ side takes), or says why it
cannot (a short reason, logged once when the model is bound; the per-op kernel path then
runs its decode steps). A description covers

    x = x + [attn_out_norm](o_proj(attention(rotary([q/k norm](qkv_proj(norm(x)))))))
    x = x + [mlp_out_norm](down_proj(act(gate) * up))      (or a plain MLP's down(act(up)))

with RMSNorms or LayerNorms (with or without biases; StableLM, Cohere) and, as Cohere's,
attention and the MLP in parallel on one normed input (Gemma's (1 + w) is folded into the
weights at load; the pre-norms may be
absent where the outputs' norms are there, OLMo 2's and EXAONE 4's layout; q / k norms a
head's or over the whole projection, OLMo 2's), an optional qkv bias,
full or partial rotary from the model's table or the sliding layers' own (Gemma 3), a
sliding window per layer, layers without rotary (NoPE: SmolLM3), queries scaled by their
position after the rotary (Ministral 3; run_tokens, which has the positions), any softmax scale,
soft-capped scores (Gemma 2), attention sinks (gpt-oss), SiLU, tanh-GELU or GELU, gated or
plain MLPs (Starcoder2, Phi, GPT-NeoX), each layer's MLP at its own width, a bias on any
linear, an embedding scale, and each branch's output scaled before the residual add
(Granite's residual multiplier); attention's output gated by sigmoid(attn_gate(x)), and gated
DeltaNet layers over each sequence's recurrent state in attention's place (Qwen3.5:
set_state_rows before each run); and routed experts in a layer's MLP place (SparseMoE's
experts of any format behind the softmax or grouped sigmoid router, a shared expert beside
them on the MLP's linears, gated or not: bind_moe; steps of at most the fused op's rows,
larger ones read each expert once, op by op), or beside a dense MLP (Gemma 4); and Gemma 4's
layers: each its own head size and KV heads (its caches'), weightless v norms, values from
the keys' projection, layers attending an earlier layer's cache, per-layer inputs
(set_per_layer_inputs before each run) and a scalar on the stream at each layer's end. What
it does not cover (other routers,
tensor-parallel layers that all-reduce, a linear layer that does not run on the C++ int4 /
int8 / bf16 kernels) keeps the model op by op.
An adapted linear (servelm.layers.lora.LoRALinear) runs its base on those kernels and its
adapters' deltas after it (bind_lora), for the rows of the step whose slot the model's
LoRAStep gives (set_lora_rows, before each run).
`servelm.models.decoder.CausalLM`'s stack methods delegate here.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from servelm.kernels import load_ops

logger = logging.getLogger(__name__)


# ---- the layer description as the C++ constructor takes it (decode_stack.cpp's enums) ------

class NormSlot(enum.IntEnum):
    """Per layer, its norm weights in this order (an empty tensor where it has none)."""

    INPUT = 0
    POST_ATTENTION = 1
    Q = 2
    K = 3
    ATTN_OUT = 4
    MLP_OUT = 5
    INPUT_BIAS = 6  # a LayerNorm's bias
    POST_ATTENTION_BIAS = 7
    LAYER_SCALAR = 8  # [1]: the residual stream times it at the layer's end (Gemma 4)
    PLE_NORM = 9  # the norm of its per-layer input's projection (Gemma 4)
    MOE_MLP_NORM = 10  # experts beside the MLP (Gemma 4): the MLP output's norm,
    MOE_INPUT_NORM = 11  # the experts' input's (of the stream)
    MOE_OUT_NORM = 12  # and their output's


class LayerOption(enum.IntEnum):
    """Per layer, these integers."""

    WINDOW = 0  # > 0: the layer attends its last WINDOW keys
    ROTARY_TABLE = 1  # 0: the model's rotary table, 1: the sliding layers' (rotary_local),
    #                   2: none (a NoPE layer: no dims turn)
    KV_GROUP = 2  # its block group (a hybrid model's KV pages): which table and slot it uses
    KIND = 3  # a LayerKind
    # A linear-attention layer's shape: key heads, value heads, their sizes, its convolution's
    # kernel (0 for an attention layer).
    LINEAR_KEY_HEADS = 4
    LINEAR_VALUE_HEADS = 5
    LINEAR_KEY_DIM = 6
    LINEAR_VALUE_DIM = 7
    CONV_KERNEL = 8
    MLP_KIND = 9  # an MlpKind
    SINKS = 10  # 1: its attention has sinks, a logit per query head in the softmax (bind_sinks)
    KV_SHARED = 11  # 1: it attends an earlier layer's caches (its own) and writes none; qkv is q
    K_EQ_V = 12  # 1: its values are its keys as projected; qkv is q | k


class LayerKind(enum.IntEnum):
    ATTENTION = 0
    LINEAR_ATTENTION = 1  # a gated DeltaNet over each sequence's recurrent state (Qwen3.5)


class MlpKind(enum.IntEnum):
    DENSE = 0
    ROUTED_EXPERTS = 1  # a router and experts (bind_moe); MLP linears: a shared expert's, or none
    EXPERTS_BESIDE = 2  # the dense MLP and routed experts beside it (Gemma 4: bind_moe)


class ModelOption(enum.IntEnum):
    NUM_HEADS = 0
    NUM_KV_HEADS = 1
    ROTARY_DIM = 2  # the first ROTARY_DIM dims of each head turn (head_dim: all)
    ACTIVATION = 3  # an Activation
    Q_SCALE_PERIOD = 4  # the query scale's period (Q_SCALE_BETA)
    PRE_NORMS = 5  # 1: norms before attention and the MLP; 0: after them alone (OLMo 2)
    QK_NORM_WHOLE = 6  # 1: the q / k norms span the whole projection, not a head (OLMo 2)
    LAYER_NORM = 7  # 1: the pre-norms and the final norm are LayerNorms (StableLM, Cohere)
    PARALLEL = 8  # 1: attention and the MLP read one normed input, their outputs summed
    PLAIN_MLP = 9  # 1: the MLP is not gated, down(act(up(x))) (Starcoder2, Phi, GPT-NeoX)
    LOCAL_ROTARY_DIM = 10  # the sliding layers' rotary table's width (0: ROTARY_DIM's)
    V_NORM = 11  # 1: each head's v over its root mean square, no weight (Gemma 4)
    PER_LAYER_INPUT = 12  # P > 0: each layer adds a per-layer input of P (Gemma 4; set_per_layer_inputs)


class ModelScalar(enum.IntEnum):
    EPS = 0
    SCALE = 1  # the softmax scale
    EMBED_SCALE = 2
    ATTN_SOFTCAP = 3  # scores soft-capped, cap * tanh(s / cap) (Gemma 2); 0: none
    RESIDUAL_SCALE = 4  # each branch's output times this before the residual add (Granite)
    Q_SCALE_BETA = 5  # queries times 1 + beta ln(1 + floor(position / period)) (Ministral 3); 0: none


class Activation(enum.IntEnum):
    SILU = 0
    GELU_TANH = 1
    GELU = 2  # erf's


_ACTIVATIONS = {"silu": Activation.SILU, "gelu_tanh": Activation.GELU_TANH,
                "gelu": Activation.GELU}


@dataclass(frozen=True)
class LayerDescription:
    qk_norm: bool
    sandwich_norms: bool
    qkv_bias: bool
    window: int  # 0: full attention
    local_rotary: bool
    kv_group: int = 0  # its block group (DecoderLayer.kv_group)
    rope: bool = True  # False: a NoPE layer (SmolLM3's every fourth)
    output_gate: bool = False  # attention's output times sigmoid(attn_gate(x)) (Qwen3.5)
    # A linear-attention layer's (key heads, value heads, key dim, value dim, conv kernel);
    # None: an attention layer.
    linear: tuple[int, int, int, int, int] | None = None
    routed_experts: bool = False  # its MLP is routed experts (SparseMoE: bind_moe)
    sinks: bool = False  # its attention has sinks (gpt-oss: bind_sinks)
    experts_beside: bool = False  # routed experts beside its MLP (Gemma 4: bind_moe)
    kv_shared: bool = False  # it attends an earlier layer's KV cache (Gemma 4)
    k_eq_v: bool = False  # its values are its keys' projection (Gemma 4's global layers)


@dataclass(frozen=True)
class StackDescription:
    """What the DecodeStack needs to know of a model beyond its tensors."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    activation: Activation
    eps: float
    scale: float
    embed_scale: float
    layers: tuple[LayerDescription, ...]
    attn_softcap: float = 0.0
    residual_scale: float = 1.0
    q_scale_beta: float = 0.0  # (run_tokens alone: the step's positions)
    q_scale_period: int = 0
    pre_norms: bool = True
    qk_norm_whole: bool = False
    layer_norm: bool = False
    parallel: bool = False
    plain_mlp: bool = False
    local_rotary_dim: int = 0  # the sliding layers' table's width (0: rotary_dim)
    v_norm: bool = False
    per_layer_input: int = 0  # P: the per-layer inputs' width (0: none)

    def layer_options(self) -> list[int]:
        out = []
        for layer in self.layers:
            opts = [0] * len(LayerOption)
            opts[LayerOption.WINDOW] = layer.window
            opts[LayerOption.ROTARY_TABLE] = int(layer.local_rotary) if layer.rope else 2
            opts[LayerOption.KV_GROUP] = layer.kv_group
            if layer.linear is not None:
                opts[LayerOption.KIND] = LayerKind.LINEAR_ATTENTION
                (opts[LayerOption.LINEAR_KEY_HEADS], opts[LayerOption.LINEAR_VALUE_HEADS],
                 opts[LayerOption.LINEAR_KEY_DIM], opts[LayerOption.LINEAR_VALUE_DIM],
                 opts[LayerOption.CONV_KERNEL]) = layer.linear
            opts[LayerOption.MLP_KIND] = (MlpKind.ROUTED_EXPERTS if layer.routed_experts
                                          else MlpKind.EXPERTS_BESIDE if layer.experts_beside
                                          else MlpKind.DENSE)
            opts[LayerOption.SINKS] = int(layer.sinks)
            opts[LayerOption.KV_SHARED] = int(layer.kv_shared)
            opts[LayerOption.K_EQ_V] = int(layer.k_eq_v)
            out += opts
        return out

    def model_options(self) -> list[int]:
        opts = [0] * len(ModelOption)
        opts[ModelOption.NUM_HEADS] = self.num_heads
        opts[ModelOption.NUM_KV_HEADS] = self.num_kv_heads
        opts[ModelOption.ROTARY_DIM] = self.rotary_dim
        opts[ModelOption.ACTIVATION] = int(self.activation)
        opts[ModelOption.Q_SCALE_PERIOD] = self.q_scale_period
        opts[ModelOption.PRE_NORMS] = int(self.pre_norms)
        opts[ModelOption.QK_NORM_WHOLE] = int(self.qk_norm_whole)
        opts[ModelOption.LAYER_NORM] = int(self.layer_norm)
        opts[ModelOption.PARALLEL] = int(self.parallel)
        opts[ModelOption.PLAIN_MLP] = int(self.plain_mlp)
        opts[ModelOption.LOCAL_ROTARY_DIM] = self.local_rotary_dim
        opts[ModelOption.V_NORM] = int(self.v_norm)
        opts[ModelOption.PER_LAYER_INPUT] = self.per_layer_input
        return opts

    def model_scalars(self) -> list[float]:
        s = [0.0] * len(ModelScalar)
        s[ModelScalar.EPS] = self.eps
        s[ModelScalar.SCALE] = self.scale
        s[ModelScalar.EMBED_SCALE] = self.embed_scale
        s[ModelScalar.ATTN_SOFTCAP] = self.attn_softcap
        s[ModelScalar.RESIDUAL_SCALE] = self.residual_scale
        s[ModelScalar.Q_SCALE_BETA] = self.q_scale_beta
        return s


def available() -> bool:
    """Whether decode_stack.cpp registered the DecodeStack class: it builds empty on a CPU
    without AVX-512 BF16 (torch.classes raises RuntimeError, not AttributeError, for a
    missing one)."""
    if not load_ops("decode_stack"):
        return False
    try:
        torch.classes.servelm_stack.DecodeStack
    except (RuntimeError, AttributeError):
        return False
    return True


# ---- describing a model ----------------------------------------------------------------------

def describe_layer(layer) -> LayerDescription | str:
    """The layer as the stack takes it, or why it cannot (a short reason)."""
    from servelm.layers.stack import base_linear
    from servelm.models.layers import MLP, Attention, GatedMLP, LayerNorm, NoNorm, RMSNorm
    from servelm.models.linear_attention import GatedDeltaNet
    from servelm.models.moe import SparseMoE

    linear = getattr(layer, "linear", False)
    attn, mlp = (None if linear else layer.self_attn), layer.mlp
    if not linear and type(attn) is not Attention:  # e.g. tensor parallel's (all-reduces)
        return f"its attention is {type(attn).__name__}, not the plain Attention"
    if linear and type(layer.linear_attn) is not GatedDeltaNet:
        return f"its linear attention is {type(layer.linear_attn).__name__}, not the plain GatedDeltaNet"
    routed = type(mlp) is SparseMoE
    if routed:
        why = mlp.stack_reason()
        if why is not None:
            return f"{why} (routed experts run op by op)"
        if getattr(layer, "parallel", False):
            return "its routed experts run in parallel with attention"
    elif type(mlp) not in (GatedMLP, MLP):
        return (f"its MLP is {type(mlp).__name__} (routed experts run op by op)"
                if hasattr(mlp, "experts_gate_up") or "MoE" in type(mlp).__name__
                else f"its MLP is {type(mlp).__name__}, not a GatedMLP or MLP")
    if not routed and mlp.act not in _ACTIVATIONS:
        return f"its MLP activation {mlp.act!r} is none of {sorted(_ACTIVATIONS)}"
    if (layer.attn_out_norm is None) != (layer.mlp_out_norm is None):
        return "it has one sandwich norm without the other"
    if getattr(layer, "parallel", False) and linear:
        return "its linear attention and MLP run in parallel"
    if getattr(layer, "parallel", False) and (layer.attn_out_norm is not None
                                              or layer.residual_scale != 1.0):
        return "its attention and MLP run in parallel, with output norms or scales"
    if not linear:
        if attn.q_scale_beta and attn.q_scale_offset:
            return "its queries are scaled by their position (attention temperature)"
        if attn.chunk:
            return "its attention is chunked (keys from the query's own chunk only)"
        if attn.qk_l2_norm:
            return "its q and k are L2-normalised after the rotary"
    beside = getattr(layer, "moe", None)
    if beside is not None:
        if routed or type(beside.experts) is not SparseMoE:
            return "it has routed experts beside routed experts"
        why = beside.experts.stack_reason()
        if why is not None:
            return f"{why} (the experts beside its MLP run op by op)"
    ple = getattr(layer, "per_layer_input", None)
    if ple is not None and (routed or ple.act != mlp.act):
        return "its per-layer input's activation is not its MLP's"
    if getattr(layer, "closes_stream", False) and getattr(layer, "parallel", False):
        return "its attention and MLP run in parallel, with a per-layer input or scalar"
    pre = layer.input_layernorm
    if not isinstance(pre, (RMSNorm, NoNorm, LayerNorm)):
        return f"its norms are {type(pre).__name__}s, not RMSNorms or LayerNorms"
    if isinstance(pre, LayerNorm) and (layer.attn_out_norm is not None
                                       or isinstance(getattr(attn, "q_norm", None), LayerNorm)):
        return "its LayerNorms come with output or q/k norms"
    if isinstance(pre, NoNorm) and (not isinstance(layer.post_attention_layernorm, NoNorm)
                                    or layer.attn_out_norm is None):
        return "it has no norm before attention, but one before its MLP or none after them"
    if linear:
        la = layer.linear_attn
        if not isinstance(pre, RMSNorm) or layer.attn_out_norm is not None:
            return "its linear attention comes with norms other than RMSNorms before it"
        if la.eps != pre.eps:
            return "its linear attention's gated norm has another eps than the layer's norms"
        return LayerDescription(qk_norm=False, sandwich_norms=False, qkv_bias=False, window=0,
                                local_rotary=False, kv_group=layer.kv_group,
                                linear=(la.num_k_heads, la.num_v_heads, la.head_k_dim,
                                        la.head_v_dim, la.kernel), routed_experts=routed)
    return LayerDescription(qk_norm=attn.q_norm is not None,
                            sandwich_norms=layer.attn_out_norm is not None,
                            qkv_bias=base_linear(attn.qkv_proj).bias is not None,
                            window=attn.window or 0, local_rotary=bool(layer.local_rotary),
                            kv_group=layer.kv_group, rope=bool(attn.rope),
                            output_gate=attn.attn_gate is not None, routed_experts=routed,
                            sinks=getattr(attn, "sinks", None) is not None,
                            experts_beside=beside is not None,
                            kv_shared=bool(attn.kv_shared),
                            k_eq_v=bool(attn.k_eq_v and not attn.kv_shared))


def describe(model) -> StackDescription | str:
    """The model as the stack takes it, or why it cannot (the first layer's reason)."""
    from servelm.models.layers import MLP, LayerNorm

    cfg = model.config
    layers = []
    for i, layer in enumerate(model.layers):
        d = describe_layer(layer)
        if isinstance(d, str):
            return f"layer {i}: {d}"
        layers.append(d)
    first = next((i for i, d in enumerate(layers) if d.linear is None), None)
    if first is None:
        return "it has no attention layer"
    attn = model.layers[first].self_attn
    # Each layer's MLP on the stack's MLP linears: its own, or a MoE layer's shared expert.
    mlps = [layer.mlp.shared_expert if d.routed_experts else layer.mlp
            for layer, d in zip(model.layers, layers)]
    dense = next((m for m in mlps if m is not None), None)
    ple = model.per_layer_embed
    tables = (model.rotary, model.rotary_local)
    for i, layer in enumerate(model.layers):
        a = attn if layer.linear else layer.self_attn
        # (Each layer's KV heads and head dim are its cache's: they may differ, Gemma 4's.)
        if (a.num_heads, a.scale, a.softcap, a.v_norm) != (
                attn.num_heads, attn.scale, attn.softcap, attn.v_norm):
            return (f"layer {i}: its query heads, softmax scale, soft-cap or v norm differ from "
                    f"layer {first}'s")
        if not layer.linear and a.rope:
            table = tables[bool(layer.local_rotary)]
            if table is None or table.cos.shape[-1] != a.rotary_dim:
                return f"layer {i}: its rotary table is not its rotary_dim ({a.rotary_dim}) wide"
        if (getattr(layer, "per_layer_input", None) is None) != (ple is None):
            return f"layer {i}: it takes no per-layer input where the model makes them"
        if mlps[i] is not None and (mlps[i].act, type(mlps[i])) != (dense.act, type(dense)):
            return (f"layer {i}: its MLP's (or shared expert's) kind or activation differs from "
                    "the first one's")
        if layer.residual_scale != model.layers[0].residual_scale:
            return f"layer {i}: its residual scale differs from layer 0's"
        if (a.q_scale_beta, a.q_scale_period) != (attn.q_scale_beta, attn.q_scale_period):
            return f"layer {i}: its query scale differs from layer {first}'s"
        if (type(layer.input_layernorm), a.qk_norm_whole, getattr(layer, "parallel", False),
                type(layer.post_attention_layernorm)) != (
                type(model.layers[0].input_layernorm), attn.qk_norm_whole,
                getattr(model.layers[0], "parallel", False),
                type(model.layers[0].post_attention_layernorm)):
            return f"layer {i}: its norms' kinds or places differ from layer 0's"
    rotary_dim = model.rotary.cos.shape[-1]
    local_dim = model.rotary_local.cos.shape[-1] if model.rotary_local is not None else 0
    pre_norms = hasattr(model.layers[0].input_layernorm, "weight")
    if pre_norms and type(model.norm) is not type(model.layers[0].input_layernorm):
        return "its final norm is of another kind than its layers'"
    return StackDescription(
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        rotary_dim=rotary_dim,
        activation=_ACTIVATIONS[dense.act] if dense is not None else Activation.SILU,
        eps=(model.layers[0].attn_out_norm if not pre_norms else model.layers[0].input_layernorm).eps,
        scale=attn.scale, pre_norms=pre_norms, qk_norm_whole=bool(attn.qk_norm_whole),
        layer_norm=isinstance(model.layers[0].input_layernorm, LayerNorm),
        parallel=bool(getattr(model.layers[0], "parallel", False)),
        plain_mlp=type(dense) is MLP,
        embed_scale=cfg.embed_scale, layers=tuple(layers), attn_softcap=attn.softcap or 0.0,
        residual_scale=model.layers[0].residual_scale, q_scale_beta=float(attn.q_scale_beta),
        q_scale_period=int(attn.q_scale_period or 0) if attn.q_scale_beta else 0,
        local_rotary_dim=local_dim if local_dim != rotary_dim else 0, v_norm=bool(attn.v_norm),
        per_layer_input=ple.size if ple is not None else 0)


def layer_args(layer, rows: int = 1) -> tuple | str:
    """The layer's tensors for a DecodeStack of steps of `rows` rows: (weights, format
    codes, norms in NormSlot order, each linear's bias or an empty tensor), or why not (a
    linear layer not on the C++ kernels for calls of that many rows)."""
    from servelm.layers.stack import StackFormat, base_linear, kernel_weights

    d = describe_layer(layer)
    if isinstance(d, str):
        return d
    # qkv (or in_proj_qkvz), o (out_proj), gate_up (up), down (None, None: routed experts),
    # extra (or None), the per-layer input's gate and projection (or None, None)
    linears = list(layer.linears())
    linears += [None] * (5 - len(linears))
    ple = getattr(layer, "per_layer_input", None)
    linears += [ple.input_gate, ple.input_proj] if ple is not None else [None, None]
    mlp = ("c_fc", "c_proj") if hasattr(layer.mlp, "c_fc") else ("gate_up_proj", "down_proj")
    names = (("in_proj_qkvz", "out_proj", *mlp, "in_proj_ba")
             if layer.linear else ("qkv_proj", "o_proj", *mlp, "attn_gate"))
    names += ("per_layer_input.input_gate", "per_layer_input.input_proj")
    if d.routed_experts and isinstance(why := layer.mlp.decode_stack_args(), str):
        return why
    if d.experts_beside and isinstance(why := layer.moe.experts.decode_stack_args(), str):
        return why
    parts = [([], int(StackFormat.NONE)) if m is None else kernel_weights(m, rows) for m in linears]
    for name, p in zip(names, parts):
        if p is None:
            return f"its {name} does not run on the C++ int4 / int8 / bf16 kernels at {rows} rows"
    none = torch.empty(0)
    biases = [None if m is None else getattr(base_linear(m), "bias", None) for m in linears]
    biases = [none if b is None else b for b in biases]
    norms = [none] * len(NormSlot)
    for slot, bias_slot, norm in ((NormSlot.INPUT, NormSlot.INPUT_BIAS, layer.input_layernorm),
                                  (NormSlot.POST_ATTENTION, NormSlot.POST_ATTENTION_BIAS,
                                   layer.post_attention_layernorm)):
        # (None: a parallel block's one norm; no weight: norms after the sublayers alone.)
        if getattr(norm, "weight", None) is not None:
            norms[slot] = norm.weight
        if getattr(norm, "bias", None) is not None:  # a LayerNorm's
            norms[bias_slot] = norm.bias
    attn = None if layer.linear else layer.self_attn
    if attn is not None and attn.q_norm is not None:
        norms[NormSlot.Q] = attn.q_norm.weight
        if attn.k_norm is not None:  # (a KV-shared layer has none)
            norms[NormSlot.K] = attn.k_norm.weight
    if layer.attn_out_norm is not None:
        norms[NormSlot.ATTN_OUT] = layer.attn_out_norm.weight
        norms[NormSlot.MLP_OUT] = layer.mlp_out_norm.weight
    if getattr(layer, "layer_scalar", None) is not None:
        norms[NormSlot.LAYER_SCALAR] = layer.layer_scalar.detach().to(torch.bfloat16)
    if ple is not None:
        norms[NormSlot.PLE_NORM] = ple.norm.weight
    if d.experts_beside:
        norms[NormSlot.MOE_MLP_NORM] = layer.moe.mlp_norm.weight
        norms[NormSlot.MOE_INPUT_NORM] = layer.moe.input_norm.weight
        norms[NormSlot.MOE_OUT_NORM] = layer.moe.out_norm.weight
    return [t for ts, _ in parts for t in ts], [int(g) for _, g in parts], norms, biases


def build(description: StackDescription, parts: list[tuple], kv_caches: list[tuple],
          model=None):
    """A DecodeStack of these layers (layer_args of each) over their KV caches (a
    linear-attention layer's: its recurrent states, bound with the model's layer's
    parameters: bind_linear_attention; a MoE layer's router and experts: bind_moe; sinks:
    bind_sinks)."""
    none = torch.empty(0, dtype=torch.bfloat16)
    linear = [d.linear is not None for d in description.layers]
    stack = torch.classes.servelm_stack.DecodeStack(
        [t for p in parts for t in p[0]], [g for p in parts for g in p[1]],
        [t for p in parts for t in p[2]], [b for p in parts for b in p[3]],
        [none if lin else k for lin, (k, _) in zip(linear, kv_caches)],
        [none if lin else v for lin, (_, v) in zip(linear, kv_caches)],
        description.layer_options(), description.model_options(), description.model_scalars())
    for i, lin in enumerate(linear):
        if lin:
            la = model.layers[i].linear_attn
            stack.bind_linear_attention(i, *kv_caches[i], la.conv_weight, la.A_log, la.dt_bias,
                                        la.norm_weight)
    for i, d in enumerate(description.layers):
        if d.routed_experts:
            stack.bind_moe(i, *model.layers[i].mlp.decode_stack_args())
        if d.experts_beside:
            stack.bind_moe(i, *model.layers[i].moe.experts.decode_stack_args())
        if d.sinks:
            stack.bind_sinks(i, model.layers[i].self_attn.sinks.detach())
    return stack


def bind_lora(stack, model) -> int:
    """Each adapted linear's adapter stacks (LoRALinear.lora_a / lora_b, which the adapter
    manager fills in place) bound into the stack by reference, with its parts' bounds; the
    linears in DecoderLayer.linears() order (decode_stack.cpp's Linear). Returns how many."""
    from servelm.layers.lora import LoRALinear

    n = 0
    for i, layer in enumerate(model.layers):
        for j, m in enumerate(layer.linears()):
            if isinstance(m, LoRALinear):  # (None: a MoE layer's absent MLP linears)
                stack.bind_lora(i, j, m.lora_a, m.lora_b, list(m.bounds))
                n += 1
    return n


def set_state_rows(stack, slots: list[int], fresh: list[bool],
                   snapshots: list[int] | None = None) -> None:
    """Before a stack run of a model with linear-attention layers: each row's state slot,
    whether its token starts afresh (position 0), and the row its state is copied into after
    the step (a prefix-cache snapshot; None or -1: none)."""
    stack.set_state_rows(slots, [int(f) for f in fresh],
                         snapshots if snapshots is not None else [-1] * len(slots))


def stack_linears(layer) -> list:
    """The linear layers a stack runs of this decoder layer: DecoderLayer.linears() and its
    per-layer input's gate and projection."""
    out = [m for m in layer.linears() if m is not None]
    ple = getattr(layer, "per_layer_input", None)
    return out + ([ple.input_gate, ple.input_proj] if ple is not None else [])


def set_per_layer_inputs(model, stack, input_ids: torch.Tensor) -> None:
    """Before a stack run of a model with per-layer inputs (Gemma 4): the step's [M, layers,
    P], made by the model's PerLayerEmbedding from the ids and their scaled embedding, as the
    per-op path makes them."""
    ple = model.per_layer_embed(input_ids, model.embed(input_ids))
    stack.set_per_layer_inputs(ple.contiguous())


def set_lora_rows(model, stack) -> None:
    """Before a stack run of a model with adapters (model.lora_step): the step's row slots
    (int32 [M]), or None when no row has an adapter. A model without adapters never calls it."""
    stack.set_lora_rows(model.lora_step.tokens)


# ---- binding ---------------------------------------------------------------------------------

_logged: set[str] = set()


def _not_used(reason: str) -> bool:
    """Says once per reason (at start-up: models are bound once) why decode steps run op by
    op; returns False."""
    if reason not in _logged:
        _logged.add(reason)
        logger.info("DecodeStack not used, decode steps run op by op: %s", reason)
    return False


def unsupported_reason(model, kv_caches: list[tuple] | None = None) -> str | None:
    """Why this model (over these caches) cannot run on a DecodeStack at all, or None."""
    if kv_caches is not None and any(len(kv) != 2 for kv in kv_caches):
        return "the KV cache is quantised (the stack reads bf16 caches only)"
    if not (load_ops("quant") and load_ops("ops") and available()):
        return "the C++ kernels (AVX-512 BF16) are not available here"
    if model.embed_tokens.weight.dtype != torch.bfloat16:
        return f"the model runs in {model.embed_tokens.weight.dtype}, not bfloat16"
    d = describe(model)
    if isinstance(d, str):
        return d
    for i, layer in enumerate(model.layers):
        if getattr(layer, "linear", False):
            la, bf16 = layer.linear_attn, torch.bfloat16
            if la.conv_weight.dtype != bf16 or la.norm_weight.dtype != bf16:
                return f"layer {i}: its linear attention's weights are not bfloat16"
            if kv_caches is not None and (kv_caches[i][0].dtype != bf16 or kv_caches[i][1].dtype
                                          not in (torch.float32, bf16)):
                return f"layer {i}: its recurrent state is not bfloat16 / float32 or bfloat16"
    return None


def bind(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """CausalLM.bind_decode_layers: one DecodeStack per run of row buckets
    (linear_methods.BUCKET_ROWS) whose calls every linear layer runs on the same modules,
    each over all layers and their KV caches, with the embedding, rotary tables and final
    norm bound for run_tokens. The linear layers must be int4 / int8 / bf16 kernel layers
    (int4 also in q8act's panels; bf16, or int4 / int8 dequantised, in AMX tile order):
    servelm.tuning may choose q8act for one and a few rows and amx from 23, and then both
    kinds of step run on a stack (each holds the weights by reference). As the per-op
    kernels, from 48 rows (24 with an int8 layer, bf16 tiles from 8) its matmuls decode each
    weight tile once. Each adapted linear's adapters are bound too (bind_lora). Sets
    model._decode_stacks [(first rows, last rows, stack)], model._decode_kv,
    model.fused_decode and model.stack_runs_lora (the stacks add the adapted linears'
    deltas: they were wrapped before this bind); True when at least one stack is bound."""
    from servelm.layers.linear_methods import BUCKET_ROWS, bucket_row_range
    from servelm.layers.stack import base_linear

    model.fused_decode, model._decode_stacks, model._decode_kv = False, [], None
    model.stack_needs_positions = False
    model.stack_runs_lora = False
    reason = unsupported_reason(model, kv_caches)
    if reason is not None:
        return _not_used(reason)
    desc = describe(model)
    linears = [base_linear(m) for layer in model.layers for m in stack_linears(layer)]
    # Per bucket, the module every linear layer runs a call of that many rows on.
    used = [[id(m.module_for(rows)) if hasattr(m, "module_for") else id(m) for m in linears]
            for rows in BUCKET_ROWS]
    groups: list[list[int]] = []  # runs of buckets on the same modules
    for b in range(len(BUCKET_ROWS)):
        if groups and used[b] == used[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    bf16 = torch.bfloat16
    # The rotary tables rounded to bf16 once (rounding commutes with the per-step gather).
    cos, sin = model.rotary.cos.to(bf16).contiguous(), model.rotary.sin.to(bf16).contiguous()
    local = None
    if any(d.local_rotary for d in desc.layers):
        r = model.rotary_local
        local = r.cos.to(bf16).contiguous(), r.sin.to(bf16).contiguous()
    # Routed experts run on the stack for the steps the fused op takes (SparseMoE._fused_rows,
    # measured by tune_fused_experts); larger steps read each expert once, op by op.
    moe_rows = min((layer.mlp._fused_rows if d.routed_experts else layer.moe.experts._fused_rows
                    for layer, d in zip(model.layers, desc.layers)
                    if d.routed_experts or d.experts_beside), default=1 << 30)
    reasons, adapted = [], 0
    for group in groups:
        parts = [layer_args(layer, BUCKET_ROWS[group[0]]) for layer in model.layers]
        bad = next(((i, p) for i, p in enumerate(parts) if isinstance(p, str)), None)
        if bad is not None:
            reasons.append(f"layer {bad[0]}: {bad[1]}")
            continue
        stack = build(desc, parts, kv_caches, model)
        adapted = bind_lora(stack, model)
        # Embedding, rotary rows and the final norm too: run_tokens is the whole step.
        stack.bind_io(model.embed_tokens.weight, cos, sin, model.norm.weight)
        if getattr(model.norm, "bias", None) is not None:  # a LayerNorm's
            stack.bind_final_norm_bias(model.norm.bias)
        if local is not None:
            stack.bind_local_rotary(*local)
        lo, hi = bucket_row_range(group[0])[0], bucket_row_range(group[-1])[1]
        hi = min(hi, stack.max_rows(), moe_rows)
        if lo <= hi:
            model._decode_stacks.append((lo, hi, stack))
    if not model._decode_stacks:
        return _not_used("; ".join(dict.fromkeys(reasons)) or "no row bucket it can run")
    model._decode_kv = kv_caches
    model.fused_decode = True
    # Scaled queries need the step's positions, which only run_tokens takes.
    model.stack_needs_positions = desc.q_scale_beta != 0
    model.stack_runs_lora = adapted > 0
    return True
