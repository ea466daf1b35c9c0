"""Mixture of experts: top-k routed gated MLPs, every expert's weights read once a step.

The router scores each token over E experts (softmax in fp32), keeps its top k and, where
the family asks (`norm_topk_prob`; Mixtral always), renormalises their weights. The k
(token, expert) pairs of every token are then sorted by expert, so each expert with any
tokens runs one gate_up and one down matmul over all of them: a step reads an expert's
weights once however many tokens chose it (no per-token loop), and an expert no token chose
is not read at all. The outputs are scattered back, weighted, with one index_add.

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
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.layers import GatedMLP, gated_act


class SparseMoE(nn.Module):
    """The MLP of a MoE layer: router `gate` [E, hidden] and stacked expert weights
    experts_gate_up [E, 2 * I, hidden] (gate rows, then up) and experts_down [E, hidden, I];
    with shared_intermediate, a shared_expert (GatedMLP) and its shared_expert_gate [1, hidden];
    with router_bias, the router's bias [E]; with expert_bias, experts_gate_up_bias [E, 2 * I]
    (gate, then up) and experts_down_bias [E, hidden]; with swiglu_limit, the experts'
    activation is gpt-oss's clamped SwiGLU (swiglu_alpha its sigmoid gain) instead of act;
    router_scoring "softmax" (over all experts) or "sigmoid" (of the top k logits);
    expert_input_weighted: the weights scale the experts' inputs, not their outputs;
    shared_expert_gate False: the shared expert's output is added as it is (no gate)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, act: str = "silu", shared_intermediate: int = 0,
                 router_bias: bool = False, expert_bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.0,
                 router_scoring: str = "softmax", expert_input_weighted: bool = False,
                 shared_expert_gate: bool = True):
        super().__init__()
        if router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported router_scoring {router_scoring!r} "
                             f"(supported: softmax, sigmoid)")
        self.options = dict(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                            top_k=top_k, norm_topk_prob=norm_topk_prob, act=act,
                            shared_intermediate=shared_intermediate, router_bias=router_bias,
                            expert_bias=expert_bias, swiglu_limit=swiglu_limit,
                            swiglu_alpha=swiglu_alpha, router_scoring=router_scoring,
                            expert_input_weighted=expert_input_weighted,
                            shared_expert_gate=shared_expert_gate)
        self.intermediate, self.num_experts, self.top_k = intermediate, num_experts, top_k
        self.norm_topk_prob, self.act = norm_topk_prob, act
        self.route = self._route_sigmoid if router_scoring == "sigmoid" else self._route_softmax
        self.expert_input_weighted = expert_input_weighted
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
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

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama 4's router: the top k logits, each through a sigmoid (in fp32, then x's
        dtype), not renormalised."""
        logits, ids = self.gate(x).topk(self.top_k, dim=-1)
        return torch.sigmoid(logits.float()).to(x.dtype), ids

    def _route_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of every token."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One implementation on every path (PyTorch's matmuls and activation): nothing
        to select."""
        T, k = x.shape[0], self.top_k
        weights, ids = self.route(x)
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
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def _plain_expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return expert_mlp(x, self.experts_gate_up[e], self.experts_down[e], self.act)

    def _clamped_expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gbias = None if self.experts_gate_up_bias is None else self.experts_gate_up_bias[e]
        dbias = None if self.experts_down_bias is None else self.experts_down_bias[e]
        h = self._act(F.linear(x, self.experts_gate_up[e], gbias))
        return F.linear(h, self.experts_down[e], dbias)


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
