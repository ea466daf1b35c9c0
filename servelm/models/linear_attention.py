"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5, over a
per-sequence recurrent state instead of a KV cache.

A layer keeps, for each running sequence, two tensors in its state slot
(servelm.engine.state_cache.StateCache):

    conv  [conv_dim, kernel - 1]     the last kernel - 1 inputs of the causal depthwise
                                     convolution (activation dtype)
    ssm   [v_heads, k_dim, v_dim]    the recurrent state S (fp32, or bf16: mamba_ssm_cache_dtype)

One token t, per value head (q and k are L2-normalised, q also scaled by k_dim ** -0.5;
k-heads serve v_heads / k_heads value heads each):

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule)
    o_t = S^T q_t

with g_t = -exp(A_log) * softplus(a_t + dt_bias) and beta_t = sigmoid(b_t) from the input
projections. A prompt chunk runs the same recurrence in blocks of CHUNK tokens (the WY
form: a unit-triangular inverse per block, then one state update per block), a decode step runs
it once for every sequence of the step at once. The output is RMSNorm(o) * silu(z) per
value head (z a projection of the input), then out_proj.

Which flat tokens belong to which sequence, and each sequence's slot, come with the step
(RecurrentBatch); a sequence whose first token is at position 0 starts from a zero state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from servelm.models.layers import OpModule

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
    # The decodes' slots as a range (first, end) when they are consecutive in row order (a
    # lone decode, or sequences admitted together): the layer updates that range in place.
    dec_range: tuple[int, int] | None = None
    any_fresh: bool = False         # whether a decode starts afresh (a one-token prompt)
    # Per sequence: (tokens in, state row) where its state is copied into a prefix-cache
    # snapshot on the way (SeqInput.state_snapshot), or None; all None: [].
    snapshots: list = field(default_factory=list)
    # Every sequence is a decode, its row its index (flat row i is sequence i): the step
    # the fused C++ decode takes whole.
    decodes_only: bool = False

    @classmethod
    def build(cls, starts: list[int], lengths: list[int], slots: list[int],
              fresh: list[bool], device: torch.device,
              snapshots: list | None = None) -> "RecurrentBatch":
        if min(slots) < 0:
            raise ValueError("every sequence of a step through linear-attention layers needs "
                             "its state slot (SeqInput.state_slot)")
        dec = [i for i, n in enumerate(lengths) if n == 1]
        out = cls(starts, lengths, slots, fresh)
        if snapshots and any(s is not None for s in snapshots):
            for snap, n in zip(snapshots, lengths):
                if snap is not None and not 0 < snap[0] <= n:
                    raise ValueError(f"a state snapshot {snap[0]} tokens into a chunk of {n}")
            out.snapshots = list(snapshots)
        if dec:
            first = slots[dec[0]]
            if all(slots[i] == first + j for j, i in enumerate(dec)):
                out.dec_range = (first, first + len(dec))
            out.any_fresh = any(fresh[i] for i in dec)
            out.dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=device)
            out.dec_slots = torch.tensor([slots[i] for i in dec], dtype=torch.long, device=device)
            out.dec_fresh = torch.tensor([fresh[i] for i in dec], dtype=torch.bool, device=device)
            out.decodes_only = len(dec) == len(lengths) and all(
                starts[i] == i for i in range(len(lengths)))
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
    scaled, both normalised), v [B, H, Dv], g, beta [B, H], all fp32. Returns o [B, H, Dv].

    With d = exp(g): S' = d S + k delta^T, delta = beta (v - d S^T k), and o = S'^T q =
    d S^T q + (q . k) delta, so S is read once for both products (one batched matmul of
    [k; q]) and then updated in place."""
    B, H, Dk, Dv = S.shape
    d = g.exp()
    flat = S.view(B * H, Dk, Dv)
    kq = torch.stack((k, q), dim=2).view(B * H, 2, Dk)
    read = torch.bmm(kq, flat).view(B, H, 2, Dv) * d[..., None, None]   # d S^T k, d S^T q
    delta = (v - read[:, :, 0]) * beta[..., None]
    o = read[:, :, 1] + (q * k).sum(-1, keepdim=True) * delta
    S.mul_(d[..., None, None])
    flat.baddbmm_(k.reshape(B * H, Dk, 1), delta.reshape(B * H, 1, Dv))
    return o


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., n, n] strictly lower triangular (nilpotent): the product
    (I - A)(I + A^2)(I + A^4)... up to A^(n/2), a few batched matmuls instead of a
    triangular solve per block."""
    n = A.shape[-1]
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    T = eye - A
    P = A
    span = 2
    while span < n:
        P = P @ P
        T = T + T @ P
        span *= 2
    return T


_MASKS: dict[tuple[int, str, bool], torch.Tensor] = {}


def _lower(n: int, device: torch.device, strict: bool) -> torch.Tensor:
    key = (n, str(device), strict)
    if key not in _MASKS:
        _MASKS[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1 if strict else 0)
    return _MASKS[key]


def delta_rule_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The recurrence over L tokens of one sequence in blocks of `chunk`: S [H, Dk, Dv]
    updated in place; q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], fp32. Returns
    o [L, H, Dv].

    Within a block, with c the cumulative log decay from its start, the delta rule's
    updates fold into U = T (beta v) and W = T (beta exp(c) k), T = (I + A)^-1 for A the
    strictly lower [i, j] = beta_i (k_i . k_j) exp(c_i - c_j): every block's T, U, W and
    causal in-block scores at once, then one pass over the blocks that reads the state once
    each (new values U - W S) and writes it once. Padding tokens (k = v = 0, no decay)
    change nothing."""
    L, H, Dk = k.shape
    Dv = v.shape[-1]
    n = min(chunk, L)
    nb = -(-L // n)
    pad = nb * n - L
    # [H, blocks, n, D] from here on.
    def blocks(t, fill=0.0):
        t = t.transpose(0, 1)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad),
                                        value=fill)
        return t.reshape(H, nb, n, *t.shape[2:])
    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    c = g.cumsum(-1)                                               # [H, nb, n]
    diff = c[..., :, None] - c[..., None, :]                        # c_i - c_j
    decay = torch.where(_lower(n, q.device, False), diff, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay * _lower(n, q.device, True)
    T = _unit_lower_inverse(A)
    U = T @ (v * beta[..., None])                                   # [H, nb, n, Dv]
    W = T @ (kb * c.exp()[..., None])                               # [H, nb, n, Dk]
    attn = (q @ k.transpose(-1, -2)) * decay                        # causal, diagonal kept
    qd = q * c.exp()[..., None]
    last = c[..., -1:]                                              # [H, nb, 1]
    kt = (k * (last - c).exp()[..., None]).transpose(-1, -2)        # [H, nb, Dk, n]
    bd = last.exp()[..., None]                                      # [H, nb, 1, 1]
    out = torch.empty(H, nb, n, Dv, dtype=torch.float32, device=q.device)
    for b in range(nb):
        new_v = U[:, b] - W[:, b] @ S
        out[:, b] = qd[:, b] @ S + attn[:, b] @ new_v
        S.mul_(bd[:, b])
        S.add_(kt[:, b] @ new_v)
    return out.reshape(H, nb * n, Dv)[:, :L].transpose(0, 1)


class GatedDeltaNet(OpModule):
    """A linear-attention layer (module docstring). Parameters as the decoder holds them:
    in_proj_qkvz rows q | k | v | z (each block head by head), in_proj_ba rows b | a,
    conv_weight [conv_dim, kernel], A_log and dt_bias [v_heads], norm_weight [v_dim] (the
    gated RMSNorm's, no offset), out_proj. The decode update chosen once (select): the
    PyTorch delta_rule_step over gathered (or consecutive) slots, or servelm's C++ step
    (kernels/csrc/delta_rule.cpp) on the slots in place, each state read and written
    once; with the C++ kernels a decode-only step (fp32 or bf16) runs everything between
    the two projections in one C++ call (servelm_delta_rule.decode: the convolution step,
    the gates, the delta rule and the gated norm), where the op-by-op path spends about 40
    small PyTorch ops a layer."""

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
        self.select(False)

    def select(self, kernels: bool) -> None:
        from servelm.kernels import load_ops

        self.uses_kernels = kernels and load_ops("delta_rule")
        self._step = torch.ops.servelm_delta_rule.step if self.uses_kernels else None
        self._decode = torch.ops.servelm_delta_rule.decode if self.uses_kernels else None

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
        if (self._decode is not None and rec.decodes_only
                and x.dtype in (torch.float32, torch.bfloat16)
                and x.dtype == conv_state.dtype == self.conv_weight.dtype
                == self.norm_weight.dtype):
            out = self._decode(ssm_state, conv_state, rec.dec_slots, rec.dec_fresh, mixed,
                               self.in_proj_ba(x), z, self.conv_weight, self.A_log,
                               self.dt_bias, self.norm_weight, self.num_k_heads, self.eps)
            for i, snap in enumerate(rec.snapshots):  # a decode's: after its token
                if snap is not None:
                    self._snapshot(conv_state, ssm_state, rec.slots[i], snap[1])
            return self.out_proj(out if rows is None else out[rows])
        b, a = self.in_proj_ba(x).float().chunk(2, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        core = torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32,
                           device=x.device)
        if rec.dec_rows is not None:
            self._decodes(mixed, g, beta, conv_state, ssm_state, rec, core)
        for i in rec.prompts:
            lo, n = rec.starts[i], rec.lengths[i]
            snap = rec.snapshots[i] if rec.snapshots else None
            m = n if snap is None else snap[0]  # a snapshot inside: the chunk in two parts
            self._prompt(mixed[lo:lo + m], g[lo:lo + m], beta[lo:lo + m], conv_state,
                         ssm_state, rec.slots[i], rec.fresh[i], core[lo:lo + m])
            if m < n:
                self._snapshot(conv_state, ssm_state, rec.slots[i], snap[1])
                self._prompt(mixed[lo + m:lo + n], g[lo + m:lo + n], beta[lo + m:lo + n],
                             conv_state, ssm_state, rec.slots[i], False, core[lo + m:lo + n])
        for i, snap in enumerate(rec.snapshots):  # the others': at the chunk's end
            if snap is not None and snap[0] == rec.lengths[i]:
                self._snapshot(conv_state, ssm_state, rec.slots[i], snap[1])
        if rows is not None:
            core, z = core[rows], z[rows]
        out = self._gated_norm(core, z)
        return self.out_proj(out.reshape(out.shape[0], self.value_dim))

    @staticmethod
    def _snapshot(conv_state, ssm_state, slot: int, row: int) -> None:
        """The slot's state as it is now, copied into row `row` (a prefix-cache snapshot)."""
        conv_state[row].copy_(conv_state[slot])
        ssm_state[row].copy_(ssm_state[slot])

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
        # The causal depthwise convolution as kernel shifted multiply-adds (fp32).
        w = self.conv_weight.float()
        conv = seq[:n].float() * w[:, 0]
        for j in range(1, self.kernel):
            conv.add_(seq[j:j + n].float() * w[:, j])
        conv = conv.to(mixed.dtype)
        conv_state[slot].copy_(seq[-k1:].t())
        q, k, v = self._split(F.silu(conv))
        S = ssm_state[slot]
        Sf = S if S.dtype == torch.float32 else S.float()  # a bf16 state: fp32 for the chunk
        if fresh:
            Sf.zero_()
        core_out.copy_(delta_rule_chunked(Sf, q, k, v, g, beta))
        if Sf is not S:
            S.copy_(Sf)

    def _decodes(self, mixed, g, beta, conv_state, ssm_state, rec: RecurrentBatch,
                 core) -> None:
        """Every one-token sequence of the step in one batched update of its slot."""
        rows, slots, fresh = rec.dec_rows, rec.dec_slots, rec.dec_fresh
        x = mixed[rows]                                              # [B, C]
        span = slice(*rec.dec_range) if rec.dec_range is not None else None
        # Consecutive slots: the states updated in place (views); else gathered, then
        # written back.
        prev = (conv_state[span] if span is not None else conv_state[slots]).to(x.dtype)
        if rec.any_fresh:
            prev = prev.masked_fill(fresh[:, None, None], 0)
        seq = torch.cat([prev, x[:, :, None]], dim=-1)               # [B, C, K]
        conv = (seq * self.conv_weight.to(seq.dtype)).sum(-1)        # [B, C]
        if span is not None:
            conv_state[span] = seq[:, :, 1:]
        else:
            conv_state[slots] = seq[:, :, 1:].to(conv_state.dtype)
        q, k, v = self._split(F.silu(conv))
        if self._step is not None:  # the C++ step: every slot in place, read and written once
            core[rows] = self._step(ssm_state, slots, q.contiguous(), k.contiguous(),
                                    v.contiguous(), g[rows].contiguous(),
                                    beta[rows].contiguous(), fresh)
            return
        S = ssm_state[span] if span is not None else ssm_state[slots]
        Sf = S if S.dtype == torch.float32 else S.float()  # a bf16 state: fp32 for the step
        if rec.any_fresh:
            Sf.masked_fill_(fresh[:, None, None, None], 0)
        o = delta_rule_step(Sf, q, k, v, g[rows], beta[rows])
        if span is None:
            ssm_state[slots] = Sf.to(ssm_state.dtype)
        elif Sf is not S:
            S.copy_(Sf)
        core[rows] = o
