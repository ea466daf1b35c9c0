"""Mixture of experts: top-k routed gated MLPs, every expert's weights read once a step.

The router scores each token over E experts (softmax in fp32), keeps its top k and, where
the family asks (`norm_topk_prob`; Mixtral always), renormalises their weights. The k
(token, expert) pairs of every token are then sorted by expert, so each expert with any
tokens runs one gate_up and one down matmul over all of them: a step reads an expert's
weights once however many tokens chose it (no per-token loop), and an expert no token chose
is not read at all. The outputs are scattered back, weighted, with one index_add.

With servelm's C++ kernels, a step of at most fused_rows tokens (decode) runs its routed
experts in one call instead (servelm_gemv.moe_experts: every (token, expert) pair's gate_up,
activation and down over the expert's own rows, summed weighted, in fp32), where the
experts are gated MLPs of bf16 weights on the CPU (gpt-oss's clamped, biased ones too; not
Llama 4's input-weighted ones): at a few tokens the per-expert
calls' overhead, not their arithmetic, was the step (k experts a token, two matmuls each).
Such a step routes its tokens in one C++ call too (servelm_q8act.moe_route: the softmax
router, or DeepSeek-V3's grouped sigmoid one, a shared expert's gate as the router's last
row), which the whole-step DecodeStack runs as well (stack_reason, decode_stack_args).

A shared expert (Qwen2-MoE), where the family has one, runs on every token beside them:
a GatedMLP (so on the C++ ops where they run) whose output, times
sigmoid(shared_expert_gate(x)), is added to the routed experts'.

gpt-oss's experts (options, chosen at construction): a router with a bias, experts with
biases on both projections, and a clamped SwiGLU (swiglu_limit, swiglu_alpha: the gate
clamped above, up on both sides, (up + 1) * gate * sigmoid(alpha * gate)). Its router takes
the top k logits and a softmax over those: the same weights as the softmax over all then
renormalised over the top k (norm_topk_prob), which is how they are computed here.

Llama 4's (options too): the router's top k logits through a sigmoid (router_scoring
"sigmoid", no renormalisation), each chosen expert's weight multiplying that expert's INPUT
rather than its output (expert_input_weighted: expert(w * x)), and a shared expert whose
output is added ungated (shared_expert_gate False).

DeepSeek's (options too): the chosen experts' weights times routed_scaling, and shared
experts added ungated (one GatedMLP as wide as all of them). DeepSeek-V2's router is the
softmax one (not renormalised), group-limited where the family says (router_scoring
"softmax_grouped": the experts in n_group groups, each group scored by its best expert,
the top k chosen only among the topk_group best groups); DeepSeek-V3's (router_scoring
"sigmoid_grouped") scores every expert by sigmoid(logit), chooses by the score plus a
learned correction bias (score_bias: e_score_correction_bias [E]) among the topk_group
groups whose two best biased scores sum highest, and weights the chosen experts by their
unbiased scores (renormalised with norm_topk_prob). Routing runs in fp32.

Gemma 4's (options too, in ExpertsBesideMLP): the router reads its own input (the layer's
residual stream, not the experts' normalised input) through a weightless RMS norm times a
learned scale and hidden ** -0.5 (router_input_norm), and the renormalised top-k weights
are multiplied by a learned per-expert scale (per_expert_scale). The experts run beside the
layer's dense MLP, each branch with its own norms, and their sum is the layer's MLP output.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers.q8act import BLOCK, NR, dequantize_q4, panels_of
from servelm.models.layers import GatedMLP, OpModule, RMSNorm, gated_act, l2_norm
from servelm.quantization.formats import INT8PACK_K
from servelm.quantization.mxfp4 import dequantize_panels


def fused_rows(num_experts: int, top_k: int) -> int:
    """Steps of at most this many tokens take the fused routed-experts op (before
    tune_fused_experts measures further). It reads an expert's rows once per token that
    chose it, the per-expert path once a step: past about E / (2k) tokens the tokens share
    experts enough for the per-expert path to read less."""
    return max(1, num_experts // (2 * top_k))


_ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
INT8PACK_ROWS = 16  # int8 experts: fewer of an expert's rows than this take _weight_int8pack_mm


class SparseMoE(OpModule):
    """The MLP of a MoE layer: router `gate` [E, hidden] and stacked expert weights
    experts_gate_up [E, 2 * I, hidden] (gate rows, then up) and experts_down [E, hidden, I];
    with shared_intermediate, a shared_expert (GatedMLP) and its shared_expert_gate [1, hidden];
    with router_bias, the router's bias [E]; with expert_bias, experts_gate_up_bias [E, 2 * I]
    (gate, then up) and experts_down_bias [E, hidden]; with swiglu_limit, the experts'
    activation is gpt-oss's clamped SwiGLU (swiglu_alpha its sigmoid gain) instead of act;
    router_scoring "softmax" (over all experts) or "sigmoid" (of the top k logits);
    expert_input_weighted: the weights scale the experts' inputs, not their outputs;
    shared_expert_gate False: the shared expert's output is added as it is (no gate);
    DeepSeek's routers (router_scoring "softmax_grouped" / "sigmoid_grouped", n_group,
    topk_group, score_bias: e_score_correction_bias [E]) and routed_scaling, the chosen
    experts' weights' factor; Gemma 4's router_input_norm (the router's input normalised
    without weight, times router_scale [hidden] and hidden ** -0.5; eps its norm's) and
    per_expert_scale (the chosen weights times per_expert_scale [E])."""

    ROUTERS = ("softmax", "sigmoid", "softmax_grouped", "sigmoid_grouped")

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, act: str = "silu", shared_intermediate: int = 0,
                 router_bias: bool = False, expert_bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.0,
                 router_scoring: str = "softmax", expert_input_weighted: bool = False,
                 shared_expert_gate: bool = True, routed_scaling: float = 1.0,
                 n_group: int = 1, topk_group: int = 1, score_bias: bool = False,
                 router_input_norm: bool = False, per_expert_scale: bool = False,
                 eps: float = 1e-6):
        super().__init__()
        if router_scoring not in self.ROUTERS:
            raise ValueError(f"unsupported router_scoring {router_scoring!r} "
                             f"(supported: {', '.join(self.ROUTERS)})")
        if router_scoring.endswith("_grouped") and (
                n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"grouped routing needs n_group ({n_group}) dividing the "
                             f"{num_experts} experts and topk_group ({topk_group}) in "
                             f"[1, n_group]")
        self.options = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                            top_k=top_k, norm_topk_prob=norm_topk_prob, act=act,
                            shared_intermediate=shared_intermediate, router_bias=router_bias,
                            expert_bias=expert_bias, swiglu_limit=swiglu_limit,
                            swiglu_alpha=swiglu_alpha, router_scoring=router_scoring,
                            expert_input_weighted=expert_input_weighted,
                            shared_expert_gate=shared_expert_gate,
                            routed_scaling=routed_scaling, n_group=n_group,
                            topk_group=topk_group, score_bias=score_bias,
                            router_input_norm=router_input_norm,
                            per_expert_scale=per_expert_scale, eps=eps)
        self.intermediate, self.num_experts, self.top_k = intermediate, num_experts, top_k
        self.norm_topk_prob, self.act = norm_topk_prob, act
        self.route = {"softmax": self._route_softmax, "sigmoid": self._route_sigmoid,
                      "softmax_grouped": self._route_softmax_grouped,
                      "sigmoid_grouped": self._route_sigmoid_grouped}[router_scoring]
        self.routed_scaling, self.n_group, self.topk_group = routed_scaling, n_group, topk_group
        self.expert_input_weighted = expert_input_weighted
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts))
                                        if score_bias else None)
        self.router_scale = nn.Parameter(torch.ones(hidden)) if router_input_norm else None
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts)) if per_expert_scale else None
        self.eps, self.root_scale = eps, hidden ** -0.5
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # Quantised experts (quantize_experts): int8's fp32 scale a row, or int4's float16
        # scales and mins a group.
        self.register_buffer("experts_gate_up_scale", None)
        self.register_buffer("experts_down_scale", None)
        self.register_buffer("experts_gate_up_min", None)
        self.register_buffer("experts_down_min", None)
        self.expert_format = None  # quantize_experts': "int8" or "int4"; to_mxfp4's "mxfp4"
        self.experts_gate_up_bias = self.experts_down_bias = None
        if expert_bias:
            self.experts_gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.experts_down_bias = nn.Parameter(torch.empty(num_experts, hidden))
        # One expert's MLP, chosen once: the plain gated MLP, or gpt-oss's (biases, clamps).
        self._expert = self._clamped_expert if swiglu_limit is not None or expert_bias \
            else self._plain_expert
        self._act = (functools.partial(clamped_swiglu, limit=swiglu_limit, alpha=swiglu_alpha)
                     if swiglu_limit is not None else functools.partial(gated_act, act=act))
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.select(False)

    def to_mxfp4(self) -> None:
        """The routed experts kept as a checkpoint's MXFP4 (servelm.quantization.mxfp4),
        before the weights are loaded (load_mxfp4): their codes in the q8act panels, uint8
        [E, N / 16, K / 32, 2, 4, 32], and one E8M0 exponent a block, uint8 [E, N / 16,
        K / 32, 16] (experts_*_scale), for gate_up [E, 2I, hidden] and down [E, hidden, I].
        Run by servelm_q8act's MXFP4 ops for bf16 activations, else dequantised an expert
        at a time. Needs hidden and intermediate sizes that are multiples of 32."""
        o = self.options
        if o["hidden"] % BLOCK or o["intermediate"] % BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({o['hidden']}) and intermediate "
                             f"({o['intermediate']}) sizes that are multiples of {BLOCK}")
        self.expert_format = "mxfp4"
        self._mx_pending: dict[str, dict[str, object]] = {}
        self._mx_loaded: set[str] = set()
        for name in ("experts_gate_up", "experts_down"):
            w = getattr(self, name)
            self._act_dtype = w.dtype
            E, N, K = w.shape
            T = -(-N // NR)
            delattr(self, name)
            # Filled whole by load_mxfp4 (padding rows too), which every expert must reach.
            self.register_buffer(name, torch.empty(E, T, K // BLOCK, 2, 4, 32, dtype=torch.uint8,
                                                   device=w.device))
            setattr(self, name + "_scale", torch.empty(E, T, K // BLOCK, NR, dtype=torch.uint8,
                                                       device=w.device))
        self.select(self.uses_kernels)

    @torch.no_grad()
    def load_mxfp4(self, which: str, part: str, w) -> None:
        """A checkpoint's MXFP4 experts (an MXFP4Weight [E, rows, K]) into to_mxfp4's panels:
        which "gate_up" or "down"; part "all", or "gate" / "up" (their halves of gate_up,
        packed once both are in)."""
        from servelm.quantization.mxfp4 import MXFP4Weight, to_panels

        name = f"experts_{which}"
        dst, exps = getattr(self, name), getattr(self, name + "_scale")
        E, N, K = dst.shape[0], self._out_features(name), dst.shape[2] * BLOCK
        halves = self._mx_pending.setdefault(name, {})
        halves[part] = w
        if part != "all":
            if not {"gate", "up"} <= halves.keys():
                return
            g, u = halves["gate"], halves["up"]
            w = MXFP4Weight(torch.cat((g.blocks, u.blocks), 1), torch.cat((g.exps, u.exps), 1),
                            g.source)
        del self._mx_pending[name]
        if tuple(w.shape) != (E, N, K):
            raise ValueError(f"MXFP4 experts {name} have shape {tuple(w.shape)}, expected "
                             f"{(E, N, K)}")
        for e in range(E):
            to_panels(MXFP4Weight(w.blocks[e], w.exps[e], w.source), out=(dst[e], exps[e]))
        self._mx_loaded.add(name)

    @property
    def mxfp4_complete(self) -> bool:
        """Every MXFP4 expert tensor loaded (to_mxfp4's layers)."""
        return self._mx_loaded == {"experts_gate_up", "experts_down"}

    @torch.no_grad()
    def quantize_experts(self, method: str = "int8") -> None:
        """The routed experts' weights quantised, an expert at a time:

        - "int8": symmetric per output row (fp32 scales [E, N], as Int8Linear's): the fused
          op widens the rows as it reads them; the per-expert path runs PyTorch's
          int8-weight matmul on the CPU;
        - "int4": groups of 32 inputs (w = s q + m, float16 scales and mins, as
          Int4Linear's) in the q8act kernel's panels (uint8 [E, N / 16, K / 32, 2, 4, 32];
          scales and mins [E, N / 16, K / 32, 16]), for bf16 activations run by
          servelm_q8act (the fused op and int4_linear: activations quantised to int8 per
          block of 32); other activations, and without the kernels, dequantised an expert
          at a time. A hidden or intermediate size that is not a multiple of 32 keeps int8.
        """
        from servelm.quantization.numerics import quantize_int4, quantize_int8

        if self.quantized:
            return
        o = self.options
        if method == "int4" and (o["hidden"] % BLOCK or o["intermediate"] % BLOCK):
            method = "int8"
        self.expert_format = method
        for name in ("experts_gate_up", "experts_down"):
            w = getattr(self, name)
            self._act_dtype = w.dtype
            E, N, K = w.shape
            if method == "int8":
                q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
                scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
                for e in range(E):
                    q[e], scale[e] = quantize_int8(w[e])
                mins = None
            else:
                T = -(-N // NR)
                q = torch.empty(E, T, K // BLOCK, 2, 4, 32, dtype=torch.uint8, device=w.device)
                scale = torch.empty(E, T, K // BLOCK, NR, dtype=torch.float16, device=w.device)
                mins = torch.empty_like(scale)
                for e in range(E):
                    packed, scale[e], mins[e] = quantize_int4(w[e], BLOCK)
                    q[e] = panels_of(packed)
            delattr(self, name)
            self.register_buffer(name, q)
            setattr(self, name + "_scale", scale)
            setattr(self, name + "_min", mins)
        self.select(self.uses_kernels)

    @property
    def quantized(self) -> bool:
        return self.experts_gate_up_scale is not None

    @property
    def act_dtype(self) -> torch.dtype:
        """The activations' dtype (the experts' own, or theirs before quantisation)."""
        return self._act_dtype if self.quantized else self.experts_gate_up.dtype

    def select(self, kernels: bool) -> None:
        """kernels: a step of at most fused_rows tokens runs the routed experts in one C++
        call, where they are gated MLPs on the CPU (gpt-oss's clamped SwiGLU and biases
        too, not experts weighted on their input) of bf16 weights, of int8 beside bf16 or
        fp32 activations, or of int4 or MXFP4 beside bf16 activations, and the op is built;
        otherwise (and always without kernels) the per-expert path."""
        from servelm.layers import gemv, q8act

        self.uses_kernels = kernels
        w = self.experts_gate_up
        act = self.act_dtype
        o = self.options
        self._fused = None
        clamped = o["swiglu_limit"] is not None
        self._q4 = (self.expert_format in ("int4", "mxfp4") and kernels
                    and w.device.type == "cpu" and act == torch.bfloat16 and q8act.available())
        if self.expert_format == "int4":
            ok = self._q4 and hasattr(torch.ops.servelm_q8act, "moe_experts")
        elif self.expert_format == "mxfp4":
            ok = self._q4 and hasattr(torch.ops.servelm_q8act, "moe_experts_mxfp4")
        elif self.quantized:
            ok = act in (torch.bfloat16, torch.float32)
        else:
            ok = w.dtype == torch.bfloat16
        if (ok and kernels and w.device.type == "cpu"
                and not o["expert_input_weighted"] and (clamped or o["act"] in _ACT_CODES)
                and o["hidden"] % 8 == 0 and o["intermediate"] % 8 == 0
                and gemv.available() and hasattr(torch.ops.servelm_gemv, "moe_experts")):
            # gpt-oss's experts: the clamped SwiGLU (code 3) and fp32 biases, bound here.
            biases = (None, None) if not o["expert_bias"] else (
                self.experts_gate_up_bias.detach().float().contiguous(),
                self.experts_down_bias.detach().float().contiguous())
            limit, alpha = (o["swiglu_limit"], o["swiglu_alpha"]) if clamped else (0.0, 1.0)
            code = 3 if clamped else _ACT_CODES[o["act"]]
            if self.expert_format == "mxfp4":
                self._fused = functools.partial(
                    _fused_panels_call, torch.ops.servelm_q8act.moe_experts_mxfp4.default, code,
                    *biases, limit, alpha, (self.experts_gate_up_scale,),
                    (self.experts_down_scale,))
            elif self.expert_format == "int4":
                self._fused = functools.partial(
                    _fused_panels_call, torch.ops.servelm_q8act.moe_experts.default, code,
                    *biases, limit, alpha, (self.experts_gate_up_scale, self.experts_gate_up_min),
                    (self.experts_down_scale, self.experts_down_min))
            else:
                self._fused = functools.partial(
                    _fused_call, torch.ops.servelm_gemv.moe_experts.default, code, *biases,
                    limit, alpha, self.experts_gate_up_scale, self.experts_down_scale)
            self._fused_rows = fused_rows(self.num_experts, self.top_k)
        # Its router for those steps: one C++ call (moe_route, the DecodeStack's routing too)
        # where it is the softmax one (Gemma 4's, its input normalised and the weights scaled
        # per expert, too) or DeepSeek-V3's grouped sigmoid, over bf16 weights; a shared
        # expert's gate (its weights bf16 too) as the router's last row.
        self._route_op = None
        g = self._router_weight(self.gate)
        shared_gate = self.shared_expert_gate is not None
        if shared_gate and g is not None:
            sg = self._router_weight(self.shared_expert_gate)
            g = None if sg is None else torch.cat((g, sg))
        grouped = o["router_scoring"] == "sigmoid_grouped"
        if grouped and not (self.n_group <= 64 and self.top_k <= self.topk_group * (
                self.num_experts // self.n_group)):
            g = None  # (the op's limits; the PyTorch router then)
        if (self._fused is not None and o["router_scoring"] in ("softmax", "sigmoid_grouped")
                and not (grouped and (o["router_input_norm"] or o["per_expert_scale"]))
                and g is not None and act == torch.bfloat16 and o["hidden"] % 16 == 0
                and q8act.available() and hasattr(torch.ops.servelm_q8act, "moe_route")):
            bias = None if self.gate.bias is None else self.gate.bias.detach().float().contiguous()
            score_bias = self.e_score_correction_bias
            self._route_op = functools.partial(
                torch.ops.servelm_q8act.moe_route.default, weight=g.contiguous(),
                bias=bias, top_k=self.top_k, norm=self.norm_topk_prob,
                scale=float(self.routed_scaling), shared_gate=shared_gate,
                groups=self.n_group if grouped else 0, topk_groups=self.topk_group if grouped else 0,
                score_bias=None if score_bias is None else score_bias.detach().float().contiguous(),
                in_scale=(None if self.router_scale is None
                          else self.router_scale.detach().float().contiguous()),
                in_root=float(self.root_scale), in_eps=float(self.eps),
                expert_scale=(None if self.per_expert_scale is None
                              else self.per_expert_scale.detach().float().contiguous()))

    @staticmethod
    def _router_weight(gate: nn.Module) -> torch.Tensor | None:
        """A router's (or a shared expert's gate's) weights [N, hidden] in bf16: an
        nn.Linear's or a gemv layer's, or those the layer a one-row call runs computes with
        (a weight format's or the bfp method's, read back), rounded to bf16; None for a
        layout that is not read back (the router then runs in PyTorch)."""
        from servelm.layers.bfp import BfpLinear
        from servelm.layers.gemv import GemvLinear
        from servelm.quantization.formats import QuantLinear

        if hasattr(gate, "module_for"):  # tuned by row bucket
            gate = gate.module_for(1)
        if isinstance(gate, (nn.Linear, GemvLinear)):
            return gate.weight.detach().bfloat16()
        if isinstance(gate, (QuantLinear, BfpLinear)):
            return gate.dequantize(torch.float32).bfloat16()
        return None

    def stack_reason(self) -> str | None:
        """Why the DecodeStack cannot run this layer's router and experts (a short reason),
        or None: it runs what the fused op and moe_route run for bf16 activations on the
        CPU, experts of any format behind the softmax or grouped sigmoid router (a shared
        expert beside them runs on the stack's MLP linears: DecoderLayer.linears). From the
        layer's own options and formats (the tuner asks before the ops are selected)."""
        from servelm.layers import q8act

        o = self.options
        if self.expert_format is None and self.experts_gate_up.dtype != torch.bfloat16:
            return f"its routed experts are {self.experts_gate_up.dtype}, not bf16 or quantised"
        if (o["router_scoring"] not in ("softmax", "sigmoid_grouped") or o["expert_input_weighted"]
                or (o["router_scoring"] != "softmax"
                    and (o["router_input_norm"] or o["per_expert_scale"]))):
            return "its router is neither the softmax one nor the grouped sigmoid one"
        if o["swiglu_limit"] is None and o["act"] not in _ACT_CODES:
            return f"its experts' activation {o['act']!r} has no fused kernel"
        if (self.act_dtype != torch.bfloat16 or o["hidden"] % 16 or o["intermediate"] % 8
                or self.experts_gate_up.device.type != "cpu" or not q8act.available()):
            return "its experts do not run the fused C++ op (bf16 activations on the CPU)"
        if self._router_weight(self.gate) is None or (
                self.shared_expert_gate is not None
                and self._router_weight(self.shared_expert_gate) is None):
            return "its router's weights cannot be read back"
        return None

    def decode_stack_args(self) -> tuple | str:
        """What DecodeStack.bind_moe takes of this layer (its router, top k, renormalisation
        and scale; its experts' format code (0 int4, 1 MXFP4: panels; 2 int8, 3 bf16: rows),
        weights, scales, mins (where they have them),
        activation code, biases, limit and alpha; whether the router's last row gates a
        shared expert; the rows' weight order, tune_fused_experts'; the grouped sigmoid
        router's groups, chosen groups and score bias (0, 0, None: softmax)), or why the
        stack cannot run it (stack_reason's, or the fused op not selected)."""
        o = self.options
        why = self.stack_reason()
        if why is not None:
            return why
        if self._fused is None or self._route_op is None:
            return "its routed experts do not run the fused C++ op (the kernels are off)"
        clamped = o["swiglu_limit"] is not None
        fmt = {"int4": 0, "mxfp4": 1, "int8": 2, None: 3}[self.expert_format]
        r = self._route_op.keywords
        gbias = dbias = None
        if o["expert_bias"]:
            gbias = self.experts_gate_up_bias.detach().float().contiguous()
            dbias = self.experts_down_bias.detach().float().contiguous()
        return (r["weight"], r["bias"], self.top_k, self.norm_topk_prob, float(self.routed_scaling),
                fmt, self.experts_gate_up, self.experts_gate_up_scale, self.experts_gate_up_min,
                self.experts_down, self.experts_down_scale, self.experts_down_min,
                3 if clamped else _ACT_CODES[o["act"]], gbias, dbias,
                float(o["swiglu_limit"]) if clamped else 0.0,
                float(o["swiglu_alpha"]) if clamped else 1.0, r["shared_gate"],
                bool(self._fused.keywords.get("by_row", False)), r["groups"], r["topk_groups"],
                r["score_bias"], r["in_scale"], r["in_root"], r["in_eps"], r["expert_scale"])

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama 4's router: the top k logits, each through a sigmoid (in fp32, then x's
        dtype), not renormalised."""
        logits, ids = self.gate(x).topk(self.top_k, dim=-1)
        return torch.sigmoid(logits.float()).to(x.dtype), ids

    def _route_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of every token."""
        r = x
        if self.router_scale is not None:  # Gemma 4's router input
            r = l2_norm(x, self.eps) * self.router_scale * self.root_scale
        probs = F.softmax(self.gate(r).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[ids]
        return weights.to(x.dtype), ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, n_group] -> [T, E]: True on the experts of each token's topk_group best groups."""
        T = group_scores.shape[0]
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        per = self.num_experts // self.n_group
        return mask.unsqueeze(-1).expand(T, self.n_group, per).reshape(T, self.num_experts)

    def _route_softmax_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2's group_limited_greedy: the softmax over all experts, groups scored
        by their best expert, the top k among the topk_group best groups (the others'
        scores zeroed), times routed_scaling (renormalised with norm_topk_prob)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        groups = probs.view(-1, self.n_group, self.num_experts // self.n_group).amax(-1)
        probs = probs.masked_fill(~self._group_mask(groups), 0.0)
        weights, ids = probs.topk(self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return (weights * self.routed_scaling).to(x.dtype), ids

    def _route_sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's: sigmoid scores; the choice by score + e_score_correction_bias
        among the topk_group groups whose two best biased scores sum highest; the weights
        the chosen experts' unbiased scores (renormalised with norm_topk_prob), times
        routed_scaling."""
        scores = torch.sigmoid(self.gate(x).float())
        bias = self.e_score_correction_bias
        biased = scores if bias is None else scores + bias.float()
        groups = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        groups = groups.topk(2, dim=-1)[0].sum(-1)
        biased = biased.masked_fill(~self._group_mask(groups), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling).to(x.dtype), ids

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts (the fused op for a few tokens where select bound it, else an
        expert at a time) and the shared expert. route: the router's input where it is
        not x (Gemma 4)."""
        T, k = x.shape[0], self.top_k
        if self._fused is not None and T <= self._fused_rows:
            x = x.contiguous()
            gate = None  # (the route op's: the shared expert's gate logits)
            if self._route_op is None:
                weights, ids = self.route(x if route is None else route)
            else:
                weights, ids, gate = self._route_op(x if route is None else route.contiguous())
            routed = self._fused(x, ids, weights, self.experts_gate_up, self.experts_down)
            return self._with_shared(routed, x, gate)
        weights, ids = self.route(x if route is None else route)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)              # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        xs = x.index_select(0, tokens)
        if self.expert_input_weighted:  # expert(w * x) (Llama 4), not w * expert(x)
            xs.mul_(weights.view(-1)[order].unsqueeze(1))
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self._expert(xs[start:start + n], e)
                start += n
        if not self.expert_input_weighted:
            out.mul_(weights.view(-1)[order].unsqueeze(1))
        routed = torch.zeros_like(x).index_add_(0, tokens, out)
        return self._with_shared(routed, x)

    def _with_shared(self, routed: torch.Tensor, x: torch.Tensor,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
        """routed plus the shared expert's output (times sigmoid of its gate's logits: gate,
        where the route op gave them, else shared_expert_gate(x))."""
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            logits = self.shared_expert_gate(x) if gate is None else gate
            shared = torch.sigmoid(logits) * shared
        return routed + shared

    def _plain_expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.quantized:
            return self._linear(gated_act(self._linear(x, e, "experts_gate_up"), self.act),
                                e, "experts_down")
        return expert_mlp(x, self.experts_gate_up[e], self.experts_down[e], self.act)

    def _clamped_expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gbias = None if self.experts_gate_up_bias is None else self.experts_gate_up_bias[e]
        dbias = None if self.experts_down_bias is None else self.experts_down_bias[e]
        h = self._act(self._linear(x, e, "experts_gate_up", gbias))
        return self._linear(h, e, "experts_down", dbias)

    def _linear(self, x: torch.Tensor, e: int, name: str,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e's projection `name` of x: F.linear; for int4 (MXFP4) experts
        servelm_q8act's int4_linear (mxfp4_linear) with bf16 activations on the kernels, else
        the expert dequantised; for int8 experts,
        below INT8PACK_ROWS rows on the CPU, PyTorch's int8-weight matmul (the rows scaled
        in x's dtype, as Int8Linear's int8pack path; inputs a multiple of INT8PACK_K), else
        the int8 rows widened to x's dtype for the matmul (which runs many rows far faster:
        docs/benchmarks.md)."""
        w, scale = getattr(self, name), getattr(self, name + "_scale")
        if scale is None:
            return F.linear(x, w[e], bias)
        n = self._out_features(name)
        if self.expert_format == "mxfp4":
            if self._q4:
                return torch.ops.servelm_q8act.mxfp4_linear(
                    x.contiguous(), w[e], scale[e], n, None if bias is None else bias.float())
            return F.linear(x, dequantize_panels(w[e], scale[e], n, x.dtype), bias)
        if self.expert_format == "int4":
            mins = getattr(self, name + "_min")
            if self._q4:  # (groups of BLOCK: quantize_experts')
                return torch.ops.servelm_q8act.int4_linear(
                    x.contiguous(), w[e], scale[e], mins[e], BLOCK, n,
                    None if bias is None else bias.float())
            return F.linear(x, dequantize_q4(w[e], scale[e], mins[e], x.dtype)[:n], bias)
        if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
                and x.shape[0] < INT8PACK_ROWS and x.shape[-1] % INT8PACK_K == 0):
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), w[e], scale[e].to(x.dtype))
        else:
            y = F.linear(x, w[e].to(x.dtype)) * scale[e].to(x.dtype)
        return y if bias is None else y + bias

    def _out_features(self, name: str) -> int:
        """The rows of each expert's projection `name` (its panels may hold padding past)."""
        return self.options["hidden"] if name == "experts_down" else 2 * self.intermediate


def _fused_panels_call(op, act: int, gate_up_bias, down_bias, limit: float, alpha: float,
                       gate_up_scales: tuple, down_scales: tuple, x, ids, weights, gate_up, down,
                       by_row: bool = False):
    """servelm_q8act's fused op over panels (moe_experts: int4 experts, each projection's
    scales and mins; moe_experts_mxfp4: MXFP4 ones, each projection's exponents) with the
    layer's activation, biases and scales bound (select); by_row is the int8 / bf16 op's,
    not theirs."""
    return op(x, ids, weights, gate_up, *gate_up_scales, down, *down_scales, act,
              gate_up_bias, down_bias, limit, alpha)


def _fused_call(op, act: int, gate_up_bias, down_bias, limit: float, alpha: float,
                gate_up_scale, down_scale, x, ids, weights, gate_up, down, by_row: bool = False):
    """servelm_gemv.moe_experts with the layer's activation, biases and (int8 experts)
    scales bound (select), and the weight order measured fastest here (tune_fused_experts)."""
    return op(x, ids, weights, gate_up, down, act, gate_up_bias, down_bias, limit, alpha,
              by_row, gate_up_scale, down_scale)


@torch.no_grad()
def tune_fused_experts(model: nn.Module, rounds: int = 2) -> bool | None:
    """The fused routed-experts op's choices, measured once a model over its own MoE layers
    in turn (each call on the next layer's experts, so that its rows come from memory as in
    a step), the two sides alternating, and kept on the model (re-bound on a later select):

    - model.moe_by_row: whether it reads each block of weight rows one row after another
      (by_row) or interleaved, whichever runs one token faster here (not measured for int4
      experts, whose op reads panels);
    - model.moe_fused_rows: the most tokens a step gives it: from fused_rows' rule (where
      the tokens' expert rows are as many bytes as the experts the per-expert path reads),
      doubled while the op runs twice that many tokens in at most 0.8x the per-expert
      path's time (which pays a pair of matmuls and their dispatch an expert), at most 64,
      and no further once a side's measurement takes over half a second.

    Returns the row order; None: no layer takes the fused op."""
    import statistics
    import time

    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m._fused is not None]
    if not layers:
        return None
    first = layers[0]
    calls = [layers[i % len(layers)] for i in range(max(8, min(16, len(layers))))]

    def timed(fn) -> float:
        t = time.perf_counter()
        for m in calls:
            fn(m)
        return time.perf_counter() - t

    def ratio(a, b) -> tuple[float, float]:
        """a's time over b's (medians of `rounds`, alternating), and the slowest measurement."""
        ta, tb = [], []
        for r in range(rounds):
            for side in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
                side[1].append(timed(side[0]))
        return statistics.median(ta) / statistics.median(tb), max(ta + tb)

    by_row = getattr(model, "moe_by_row", None)
    if by_row is None and first.expert_format in ("int4", "mxfp4"):
        by_row = model.moe_by_row = False  # the int4 op's panels have no row order to choose
    if by_row is None:
        x = torch.randn(1, first.options["hidden"], dtype=first.act_dtype)
        ids = (torch.arange(first.top_k) * 3 % first.num_experts).view(1, -1)
        w = torch.full((1, first.top_k), 1.0 / first.top_k)
        by_row = ratio(
            lambda m: m._fused(x, ids, w, m.experts_gate_up, m.experts_down, by_row=True),
            lambda m: m._fused(x, ids, w, m.experts_gate_up, m.experts_down, by_row=False)
        )[0] < 1
        model.moe_by_row = by_row
    for m in layers:
        m._fused = functools.partial(m._fused, by_row=by_row)
    rows = getattr(model, "moe_fused_rows", None)
    if rows is None:
        rows = first._fused_rows
        gen = torch.Generator().manual_seed(0)
        while rows < 64:
            x = torch.randn(2 * rows, first.options["hidden"], generator=gen).to(
                first.act_dtype)

            def run(limit: int):
                def call(m):
                    m._fused_rows = limit
                    # This rank's experts alone: a tensor-parallel layer's forward would
                    # all-reduce, and each rank's measurements (hence its calls) may differ.
                    SparseMoE.forward(m, x)
                return call

            # A margin: the layer alone flatters the op against the per-expert path (the
            # whole step's other work, docs/benchmarks.md).
            r, slowest = ratio(run(2 * rows), run(0))
            if r > 0.8:
                break
            rows *= 2
            if slowest > 0.5:
                break
        model.moe_fused_rows = rows
    for m in layers:
        m._fused_rows = rows
    return by_row


class ExpertsBesideMLP(nn.Module):
    """Gemma 4's MoE block, beside a layer's dense MLP: its output m (the dense MLP's) and
    the residual stream x it read (before the MLP's norm) ->

        mlp_norm(m) + out_norm(experts(input_norm(x), routed on x))

    the router's input x itself (router_input_norm), its top-k weights renormalised and
    times the per-expert scale. The caller adds its own norm after the sum."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 act: str, eps: float):
        super().__init__()
        self.mlp_norm = RMSNorm(hidden, eps)
        self.input_norm = RMSNorm(hidden, eps)
        self.out_norm = RMSNorm(hidden, eps)
        self.experts = SparseMoE(hidden, intermediate, num_experts, top_k, True, act,
                                 router_input_norm=True, per_expert_scale=True, eps=eps)

    def forward(self, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(self.input_norm(x), route=x)
        return self.mlp_norm(m) + self.out_norm(routed)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert over all the tokens routed to it: [n, hidden] -> [n, hidden]."""
    return F.linear(gated_act(F.linear(x, gate_up), act), down)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of a fused [.., 2 * I] projection (gate, then up):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
