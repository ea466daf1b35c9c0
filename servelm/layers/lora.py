"""LoRA adapters on the linear layers: the base matmul runs once for every row of a step,
then each row's adapter adds its low-rank delta, B (A x), on that row only (Punica's and
S-LoRA's segmented form, not a merged weight per request and not one adapter per batch).

Every adapted linear (LoRALinear) holds a slot per resident adapter, stacked:

    lora_a [max_loras, J * R, K]   the A matrices of the layer's J parts, R rows each
    lora_b [max_loras, P, N, 2]    B in rank pairs (P = ceil(R / 2)): rank r of column n at
                                   [s, r // 2, n, r % 2], two ranks of a column side by side
                                   as vdpbf16ps multiplies them; its part's scale folded in

where the J parts are the fused layer's outputs (q, k, v of qkv_proj; gate and up of
gate_up_proj; one for o_proj and down_proj) with column bounds `bounds` (J + 1 ints). A
column n of part j is y[m, n] += B[s, n] . (A[s, jR:(j+1)R] x[m]) for a row m whose slot s
is >= 0. An adapter of lower rank fills its first rows of A and of B (zeros after);
a part it does not adapt stays zero. The step's slot of each row comes from LoRAStep, set
by the runner before the forward: token rows, or the sampled rows a model's last layer keeps.

`lora_add_ref` is the PyTorch reference; servelm's C++ op (`servelm_ops.lora_add`, the same
arguments) runs it on the CPU, and the DecodeStack runs it inside a whole decode step; on
CUDA `lora_add_dense` runs it without a host sync.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

# The linear layers an adapter may adapt: the decoder's module name -> PEFT's names of
# its parts, in the fused layer's column order.
TARGET_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
    # A non-gated MLP's (Starcoder2's names; Phi's fc1 / fc2).
    "c_fc": ("c_fc",),
    "c_proj": ("c_proj",),
    # A gated DeltaNet's (Qwen3.5's names; Qwen3-Next fuses each pair per key head).
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "out_proj": ("out_proj",),
}


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 row_slots: torch.Tensor, bounds: Sequence[int]) -> None:
    """y [M, N] += each row's delta in place (rows with slot -1 untouched): t = A x in fp32
    rounded to y's dtype (a model's lora_A output), then B t in fp32, rounded once into y.
    x [M, K]; lora_a [S, J*R, K]; lora_b [S, ceil(R/2), N, 2]; row_slots [M] int32; bounds:
    the J parts' column bounds (bounds[0] == 0, bounds[J] == N)."""
    R = lora_a.shape[1] // (len(bounds) - 1)
    slots = row_slots.long()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().flatten()
        t = (x[rows].float() @ lora_a[s].float().t()).to(y.dtype).float()  # [m, J*R]
        delta = torch.empty(rows.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        for j in range(len(bounds) - 1):
            c0, c1 = bounds[j], bounds[j + 1]
            delta[:, c0:c1] = t[:, j * R:(j + 1) * R] @ rank_major(lora_b[s])[:R, c0:c1].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def lora_add_dense(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   row_slots: torch.Tensor, bounds: Sequence[int]) -> None:
    """lora_add_ref's deltas with no host sync and no loop over slots (the CUDA path): every
    row against every slot's A in one matmul, each row's own slot's t kept (rounded to y's
    dtype as there) and the rest zeroed, then per part one matmul of t [M, S*R] by every
    slot's B [S*R, N_j]. A row of slot -1 gets a zero delta, so y's value is unchanged. It
    spends S times the reference's arithmetic (a decode step's few rows by a few slots: a GPU
    has it to spare) to keep the step free of the per-slot syncs a data-dependent loop makes.
    The same values as lora_add_ref up to the fp32 sums' order."""
    S, JR, K = lora_a.shape
    J, M = len(bounds) - 1, x.shape[0]
    R = JR // J
    t_all = (x.float() @ lora_a.reshape(S * JR, K).float().t()).view(M, S, J, R)
    mine = row_slots.long().unsqueeze(1) == torch.arange(S, device=x.device)  # [M, S]
    t = (t_all * mine[:, :, None, None]).to(y.dtype).float()
    b = lora_b.transpose(2, 3).reshape(S, -1, lora_b.shape[2])[:, :R].float()  # [S, R, N]
    delta = torch.empty(M, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(J):
        c0, c1 = bounds[j], bounds[j + 1]
        delta[:, c0:c1] = t[:, :, j].reshape(M, S * R) @ b[:, :, c0:c1].reshape(S * R, c1 - c0)
    y.copy_((y.float() + delta).to(y.dtype))


def rank_major(b: torch.Tensor) -> torch.Tensor:
    """One slot's B in rank pairs [P, N, 2] as [2P, N] (rank r's row of columns)."""
    return b.transpose(1, 2).reshape(-1, b.shape[1])


class LoRAStep:
    """The step's adapter slot of each row, shared by a model's LoRALinears: `tokens` for
    a layer that sees every token, `rows` for the last layer's sampled rows (the runner's
    sampled_only forward); None when no row of the step has an adapter."""

    def __init__(self):
        self.tokens: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def set(self, tokens: torch.Tensor | None, rows: torch.Tensor | None) -> None:
        self.tokens, self.rows = tokens, rows

    def clear(self) -> None:
        self.tokens = self.rows = None

    @contextmanager
    def applied(self, slots: tuple[torch.Tensor, torch.Tensor] | None):
        """Within: (tokens, rows) set, cleared after; None sets nothing."""
        if slots is None:
            yield
            return
        self.set(*slots)
        try:
            yield
        finally:
            self.clear()

    def slots(self, num_rows: int) -> torch.Tensor | None:
        """The slots of a layer input of num_rows rows (every token, or the sampled rows:
        when both counts agree every token is sampled, so the two lists are the same)."""
        if self.tokens is None:
            return None
        return self.tokens if num_rows == self.tokens.shape[0] else self.rows


class LoRALinear(nn.Module):
    """A linear layer (any of servelm's methods: `base`) with resident adapters' deltas."""

    def __init__(self, base: nn.Module, parts: Sequence[int], in_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 step: LoRAStep):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, sum(parts)
        self.bounds = tuple([0] + [sum(parts[:j + 1]) for j in range(len(parts))])
        self.max_rank = max_rank
        self.lora_a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype,
                                  device=device)
        self.lora_b = torch.zeros(max_loras, (max_rank + 1) // 2, self.out_features, 2, dtype=dtype,
                                  device=device)
        self.step = step
        self.select(False)

    def select(self, kernels: bool) -> None:
        """The delta on servelm's C++ op (CPU), on lora_add_dense (CUDA: no host sync), or the
        PyTorch reference (the CPU's eager path)."""
        op = None
        if kernels:
            try:
                op = torch.ops.servelm_ops.lora_add
            except (AttributeError, RuntimeError):  # an older build of the ops
                op = None
        if self.lora_a.is_cuda:
            op = lora_add_dense
        self._add = op or lora_add_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.step.slots(x.shape[0])
        if slots is not None:
            if y.stride(-1) != 1:
                y = y.contiguous()
            self._add(y, x, self.lora_a, self.lora_b, slots, self.bounds)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
                 ) -> None:
        """Slot `slot` holds an adapter's (A [r, K], B [N_j, r], scale folded into B) per
        part (None: that part not adapted): copied in, zero-padded to max_rank."""
        R = self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, ab in enumerate(parts):
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            c0, c1 = self.bounds[j], self.bounds[j + 1]
            self.lora_a[slot, j * R:j * R + r] = a.to(self.lora_a.dtype)
            bt = torch.zeros(2 * self.lora_b.shape[1], c1 - c0, dtype=self.lora_b.dtype,
                             device=self.lora_b.device)
            bt[:r] = b.t()
            self.lora_b[slot, :, c0:c1] = bt.view(-1, 2, c1 - c0).transpose(1, 2)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def slot_bytes(self) -> int:
        """Bytes one resident adapter takes in this layer."""
        return (self.lora_a[0].numel() + self.lora_b[0].numel()) * self.lora_a.element_size()

