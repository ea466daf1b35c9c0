"""Per-layer embeddings (PLE, Gemma 4): beside the residual stream, every decoder layer
takes a small input of its own, made once per token before the first layer and added at
the end of the layer through a gate.

Model side (PerLayerEmbedding), for the token ids and their scaled embedding x [T, hidden]:

    table = embed_tokens_per_layer(ids) * sqrt(P)                       [T, layers, P]
    proj  = per_layer_projection_norm(per_layer_model_projection(x) * hidden ** -0.5)
    inputs = (proj + table) * 2 ** -0.5                                 [T, layers, P]

(the table's row [layers * P] split per layer; the norm an RMSNorm over each layer's P;
the sqrt(P) rounded to the table's dtype, as transformers' scaled embedding does).

Layer side (PerLayerInput), at the end of layer i, after its MLP's output is added:

    x = x + norm(input_proj(act(input_gate(x)) * inputs[:, i]))

and then (decoder.py) the whole stream times the layer's scalar where it has one.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.models.layers import RMSNorm, activation


class PerLayerEmbedding(nn.Module):
    """The model's per-layer inputs [T, layers, P] (module docstring); its tensors keep the
    checkpoint's names: embed_tokens_per_layer (an nn.Embedding [vocab, layers * P]),
    per_layer_model_projection (hidden -> layers * P), per_layer_projection_norm (P)."""

    def __init__(self, vocab: int, hidden: int, num_layers: int, size: int, eps: float):
        super().__init__()
        self.num_layers, self.size = num_layers, size
        self.embed_tokens_per_layer = nn.Embedding(
            vocab, num_layers * size, _weight=torch.empty(vocab, num_layers * size))
        self.per_layer_model_projection = nn.Linear(hidden, num_layers * size, bias=False)
        self.per_layer_projection_norm = RMSNorm(size, eps)
        self.table_scale, self.projection_scale = size ** 0.5, hidden ** -0.5

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[0]
        table = self.embed_tokens_per_layer(input_ids)
        table = table * torch.tensor(self.table_scale, dtype=table.dtype)
        proj = self.per_layer_model_projection(x) * self.projection_scale
        proj = self.per_layer_projection_norm(proj.reshape(T * self.num_layers, self.size))
        out = (proj.view(T, self.num_layers, self.size)
               + table.view(T, self.num_layers, self.size)) * 2 ** -0.5
        return out


class PerLayerInput(nn.Module):
    """One layer's gated per-layer input (module docstring): input_gate (hidden -> P),
    input_proj (P -> hidden), norm (hidden), the model's activation. (Names of their own, which
    weight quantisation targets: quantization.TARGETS.)"""

    def __init__(self, hidden: int, size: int, act: str, eps: float):
        super().__init__()
        self.input_gate = nn.Linear(hidden, size, bias=False)
        self.input_proj = nn.Linear(size, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        self.act = act

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], this layer's inputs [T, P] -> what the layer adds to x."""
        return self.norm(self.input_proj(activation(self.input_gate(x), self.act) * inputs))
