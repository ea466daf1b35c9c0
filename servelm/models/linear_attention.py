"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5, over a
per-sequence recurrent state instead of a KV cache.

A layer keeps, for each running sequence, two tensors in its state slot
(servelm.engine.state_cache.StateCache):

    conv  [conv_dim, kernel - 1]     the last kernel - 1 inputs of the causal depthwise
                                     convolution (activation dtype)
    ssm   [v_heads, k_dim, v_dim]    the recurrent state S (fp32)

One token t, per value head (q and k are L2-normalised, q also scaled by k_dim ** -0.5;
k-heads serve v_heads / k_heads value heads each):

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule)
    o_t = S^T q_t

with g_t = -exp(A_log) * softplus(a_t + dt_bias) and beta_t = sigmoid(b_t) from the input
projections. A prompt chunk runs the same recurrence in blocks of CHUNK tokens (the WY
form: a triangular solve per block, then one state update per block), a decode step runs
it once for every sequence of the step at once. The output is RMSNorm(o) * silu(z) per
value head (z a projection of the input), then out_proj.

Which flat tokens belong to which sequence, and each sequence's slot, come with the step
(RecurrentBatch); a sequence whose first token is at position 0 starts from a zero state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from servelm.attention.metadata import ForwardBatch

CHUNK = 64  # tokens per block of a prompt's chunked recurrence


@dataclass
class RecurrentBatch:
    """A step's sequences as the linear-attention layers see them, in flat token order:
    each one's first flat token, token count, state slot and whether it starts afresh (its
    first token is at position 0). Decodes (one token each) are also gathered into index
    tensors so a layer runs them in one batched update."""

    starts: list[int]
    lengths: list[int]
    slots: list[int]
    fresh: list[bool]
    # The one-token sequences: their flat rows, slots and fresh flags as tensors.
    dec_rows: torch.Tensor | None = None
    dec_slots: torch.Tensor | None = None
    dec_fresh: torch.Tensor | None = None

    @classmethod
    def build(cls, starts: list[int], lengths: list[int], slots: list[int],
              fresh: list[bool], device: torch.device) -> "RecurrentBatch":
        if min(slots) < 0:
            raise ValueError("every sequence of a step through linear-attention layers needs "
                             "its state slot (SeqInput.state_slot)")
        dec = [i for i, n in enumerate(lengths) if n == 1]
        out = cls(starts, lengths, slots, fresh)
        if dec:
            out.dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=device)
            out.dec_slots = torch.tensor([slots[i] for i in dec], dtype=torch.long, device=device)
            out.dec_fresh = torch.tensor([fresh[i] for i in dec], dtype=torch.bool, device=device)
        return out

    @property
    def prompts(self) -> list[int]:
        """The sequences with more than one token this step."""
        return [i for i, n in enumerate(self.lengths) if n > 1]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of every row: S [B, H, Dk, Dv] updated in place; q, k [B, H, Dk] (q
    scaled, both normalised), v [B, H, Dv], g, beta [B, H], all fp32. Returns o [B, H, Dv]."""
    S.mul_(g.exp()[..., None, None])
    kv = torch.einsum("bhkv,bhk->bhv", S, k)
    delta = (v - kv) * beta[..., None]
    S.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", S, q)


def delta_rule_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The recurrence over L tokens of one sequence in blocks of `chunk`: S [H, Dk, Dv]
    updated in place; q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], fp32. Returns
    o [L, H, Dv].

    Within a block, with c the cumulative log decay from its start, the delta rule's L
    updates fold into U = T (beta v) and W = T (beta exp(c) k), T = (I + A)^-1 for A the
    strictly lower [i, j] = beta_i (k_i . k_j) exp(c_i - c_j); the block then reads the
    state once (new values U - W S), attends within itself causally with the same decays,
    and writes the state once."""
    L = q.shape[0]
    out = torch.empty(L, v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    # [H, L, D] from here on.
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    for lo in range(0, L, chunk):
        hi = min(L, lo + chunk)
        n = hi - lo
        qc, kc, vc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]
        bc = beta[:, lo:hi, None]
        c = g[:, lo:hi].cumsum(-1)                                 # [H, n]
        decay = (c[:, :, None] - c[:, None, :])                    # [H, n, n]: c_i - c_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, decay, float("-inf")).exp()     # 0 above the diagonal
        kb = kc * bc
        A = (kb @ kc.transpose(-1, -2)) * decay
        # (I + strictly-lower A) X = B: the triangular solve with a unit diagonal.
        U = torch.linalg.solve_triangular(A, vc * bc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(A, kb * c.exp()[..., None], upper=False,
                                          unitriangular=True)
        new_v = U - W @ S                                          # [H, n, Dv]
        attn = (qc @ kc.transpose(-1, -2)) * decay                 # causal, diagonal kept
        o = (qc * c.exp()[..., None]) @ S + attn @ new_v
        out[lo:hi] = o.transpose(0, 1)
        last = c[:, -1:]                                           # [H, 1]
        S.mul_(last.exp()[..., None])
        S.add_((kc * (last - c).exp()[..., None]).transpose(-1, -2) @ new_v)
    return out


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (module docstring). Parameters as the decoder holds them:
    in_proj_qkvz rows q | k | v | z (each block head by head), in_proj_ba rows b | a,
    conv_weight [conv_dim, kernel], A_log and dt_bias [v_heads], norm_weight [v_dim] (the
    gated RMSNorm's, no offset), out_proj."""

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.eps = eps
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv, ssm) shapes."""
        return ((self.conv_dim, self.kernel - 1),
                (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def forward(self, x: torch.Tensor, cos, sin, batch: ForwardBatch,
                state: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [T, hidden] in the step's flat order; every sequence's state slot is read and
        written; with rows, only those tokens' outputs go through out_proj and come back."""
        conv_state, ssm_state = state
        rec: RecurrentBatch = batch.recurrent
        if rec is None:
            raise ValueError("a step through linear-attention layers needs each sequence's "
                             "state slot (SeqInput.state_slot)")
        T = x.shape[0]
        proj = self.in_proj_qkvz(x)
        mixed, z = proj.split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).float().chunk(2, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        core = torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32,
                           device=x.device)
        if rec.dec_rows is not None:
            self._decodes(mixed, g, beta, conv_state, ssm_state, rec, core)
        for i in rec.prompts:
            lo, n = rec.starts[i], rec.lengths[i]
            self._prompt(mixed[lo:lo + n], g[lo:lo + n], beta[lo:lo + n], conv_state,
                         ssm_state, rec.slots[i], rec.fresh[i], core[lo:lo + n])
        if rows is not None:
            core, z = core[rows], z[rows]
        out = self._gated_norm(core, z)
        return self.out_proj(out.reshape(out.shape[0], self.value_dim))

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's output (fp32, then weighted in the activations'
        dtype) times silu(z)."""
        dtype = z.dtype
        core = core.to(dtype).float()  # the core's output in the activations' dtype first
        h = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm_weight * h.to(dtype)
        zf = z.reshape(z.shape[0], self.num_v_heads, self.head_v_dim).float()
        return (h * F.silu(zf)).to(dtype)

    def _split(self, mixed: torch.Tensor):
        """The convolution's output [n, conv_dim] -> q, k [n, Hv, Dk] (normalised, q
        scaled, k-heads repeated for their value heads) and v [n, Hv, Dv], fp32."""
        n = mixed.shape[0]
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.view(n, self.num_k_heads, self.head_k_dim))
        k = l2_normalize(k.view(n, self.num_k_heads, self.head_k_dim))
        r = self.num_v_heads // self.num_k_heads
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q * self.head_k_dim ** -0.5, k, v.view(n, self.num_v_heads, self.head_v_dim)

    def _prompt(self, mixed, g, beta, conv_state, ssm_state, slot: int, fresh: bool,
                core_out) -> None:
        """One sequence's chunk of n tokens: its convolution over the slot's last inputs,
        then the chunked recurrence from the slot's state; both slot tensors updated."""
        n = mixed.shape[0]
        k1 = self.kernel - 1
        prev = (torch.zeros(k1, self.conv_dim, dtype=mixed.dtype, device=mixed.device)
                if fresh else conv_state[slot].t().to(mixed.dtype))
        seq = torch.cat([prev, mixed], dim=0)                       # [k1 + n, C]
        conv = F.conv1d(seq.t()[None], self.conv_weight[:, None, :].to(seq.dtype),
                        groups=self.conv_dim)[0].t()                 # [n, C]
        conv_state[slot].copy_(seq[-k1:].t())
        q, k, v = self._split(F.silu(conv))
        S = ssm_state[slot]
        if fresh:
            S.zero_()
        core_out.copy_(delta_rule_chunked(S, q, k, v, g, beta))

    def _decodes(self, mixed, g, beta, conv_state, ssm_state, rec: RecurrentBatch,
                 core) -> None:
        """Every one-token sequence of the step in one batched update of its slot."""
        rows, slots, fresh = rec.dec_rows, rec.dec_slots, rec.dec_fresh
        x = mixed[rows]                                              # [B, C]
        prev = conv_state[slots].to(x.dtype)                         # [B, C, k1]
        prev = prev.masked_fill(fresh[:, None, None], 0)
        seq = torch.cat([prev, x[:, :, None]], dim=-1)               # [B, C, K]
        conv = (seq * self.conv_weight.to(seq.dtype)).sum(-1)        # [B, C]
        conv_state[slots] = seq[:, :, 1:].to(conv_state.dtype)
        q, k, v = self._split(F.silu(conv))
        S = ssm_state[slots]
        S.masked_fill_(fresh[:, None, None, None], 0)
        o = delta_rule_step(S, q, k, v, g[rows], beta[rows])
        ssm_state[slots] = S
        core[rows] = o
