"""StateCache: the recurrent state of a model's linear-attention layers, a slot per running
sequence (the block manager hands slots out with a request's first blocks and takes them
back with its last).

Per linear-attention layer, one tensor of each kind for all slots (the depthwise
convolution's last inputs and the delta rule's matrix):

    conv  [slots, conv_dim, kernel - 1]   in the activations' dtype
    ssm   [slots, v_heads, k_dim, v_dim]  fp32: the state sums the whole sequence, so
                                          rounding would compound step after step

A slot is never cleared when it changes hands: the layer starts a sequence whose first
token is at position 0 from zeros (RecurrentBatch.fresh)."""

from __future__ import annotations

import torch

from servelm.models.config import ModelConfig


def _shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lin = cfg.extra["linear_attn"]
    kd, vd = lin["num_k_heads"] * lin["head_k_dim"], lin["num_v_heads"] * lin["head_v_dim"]
    return ((2 * kd + vd, lin["conv_kernel"] - 1),
            (lin["num_v_heads"], lin["head_k_dim"], lin["head_v_dim"]))


class StateCache:
    """Every linear-attention layer's state for num_slots sequences; `layers`: layer index
    -> (conv, ssm)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = num_slots
        conv, ssm = _shapes(cfg)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.zeros(num_slots, *conv, dtype=dtype, device=device),
                torch.zeros(num_slots, *ssm, dtype=torch.float32, device=device))
            for i in range(cfg.num_layers) if cfg.is_linear_layer(i)}

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One sequence's state in every linear-attention layer (0 for a model without)."""
        if not cfg.has_recurrent_state:
            return 0
        conv, ssm = _shapes(cfg)
        elem = torch.empty(0, dtype=dtype).element_size()
        per_layer = conv[0] * conv[1] * elem + ssm[0] * ssm[1] * ssm[2] * 4
        return per_layer * sum(cfg.is_linear_layer(i) for i in range(cfg.num_layers))
