"""StateCache: the recurrent state of a model's linear-attention layers, a slot per running
sequence (the block manager hands slots out with a request's first blocks and takes them
back with its last), and the prefix cache's snapshots of such states.

Per linear-attention layer, one tensor of each kind for all slots (the depthwise
convolution's last inputs and the delta rule's matrix):

    conv  [slots, conv_dim, kernel - 1]   in the activations' dtype
    ssm   [slots, v_heads, k_dim, v_dim]  fp32: the state sums the whole sequence, so
                                          rounding would compound step after step

A slot is never cleared when it changes hands: the layer starts a sequence whose first
token is at position 0 from zeros (RecurrentBatch.fresh)."""

from __future__ import annotations

import math

import torch

from servelm.models.config import ModelConfig


def snapshot_row(num_slots: int, snapshot: int) -> int:
    """The state tensors' row of a block manager's snapshot id (after the slots' rows)."""
    return num_slots + snapshot


class StateCache:
    """Every linear-attention layer's state for num_slots sequences, and num_snapshots
    copies of such states kept for the prefix cache (rows num_slots.. of the same tensors:
    the block manager's snapshots, restored into a slot by copy, filled by the layers
    themselves during a step: SeqInput.state_snapshot); `layers`: layer index -> (conv, ssm)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device, num_snapshots: int = 0,
                 ssm_dtype: torch.dtype = torch.float32):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        rows = num_slots + num_snapshots
        conv, ssm = cfg.linear_state_shapes
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.zeros(rows, *conv, dtype=dtype, device=device),
                torch.zeros(rows, *ssm, dtype=ssm_dtype, device=device))
            for i in cfg.linear_layers}

    def restore(self, copies: list[tuple[int, int]]) -> None:
        """(snapshot, slot) pairs: each slot's state set to the snapshot's."""
        self._copy([(snapshot_row(self.num_slots, sid), slot) for sid, slot in copies])

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            if not (0 <= src < self.num_slots + self.num_snapshots
                    and 0 <= dst < self.num_slots + self.num_snapshots):
                raise IndexError(f"state row {src} -> {dst} is outside the "
                                 f"{self.num_slots} slots and {self.num_snapshots} snapshots")
            for conv, ssm in self.layers.values():
                conv[dst].copy_(conv[src])
                ssm[dst].copy_(ssm[src])

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32) -> int:
        """One sequence's state in every linear-attention layer (0 for a model without)."""
        if not cfg.has_recurrent_state:
            return 0
        conv, ssm = cfg.linear_state_shapes
        elem = torch.empty(0, dtype=dtype).element_size()
        per_layer = (math.prod(conv) * elem
                     + math.prod(ssm) * torch.empty(0, dtype=ssm_dtype).element_size())
        return per_layer * len(cfg.linear_layers)
