"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid layers.

Three layers in four (layer_types, or every full_attention_interval-th full) are linear
attention, a gated DeltaNet over a recurrent state per sequence
(models/linear_attention.py); the others are full attention with q/k norms per head, a
partial rotary (partial_rotary_factor, 0.25 by default) and the output gated by
sigmoid(x W_gate) before o_proj. Every RMSNorm scales by (1 + w) but the DeltaNet's gated
one (w alone). MLPs: Qwen3-Next's MoE (top-k softmax routing, a shared expert gated by
sigmoid(shared_expert_gate(x)); dense on mlp_only_layers and outside decoder_sparse_step),
Qwen3.5's dense SwiGLU, Qwen3.5-MoE's MoE on every layer.

Checkpoint layouts:
- attention q_proj holds each head's query then its gate (rows [heads, 2, head_dim]): split
  at load into the queries (stacked into qkv_proj) and attn_gate;
- Qwen3-Next's linear_attn.in_proj_qkvz holds per key head [q, k, v x r, z x r] (r value
  heads a key head) and in_proj_ba [b x r, a x r]: reordered at load to the decoder's
  q | k | v | z and b | a blocks; Qwen3.5 keeps in_proj_qkv, in_proj_z, in_proj_b and
  in_proj_a apart (stacked at load);
- linear_attn.conv1d.weight [conv_dim, 1, kernel] -> conv_weight [conv_dim, kernel];
  linear_attn.norm.weight -> norm_weight.
Qwen3.5's checkpoints are multimodal (Qwen3_5ForConditionalGeneration): the text model's
config in text_config, its tensors under model.language_model (the vision tower and the
multi-token-prediction layers, mtp.*, are not read). Text positions turn the multimodal
rotary (mrope) like the plain one."""

from __future__ import annotations

import re

import numpy as np
import torch

from servelm.models.families.qwen2 import _qwen_moe
from servelm.models.families.qwen2_moe import SHARED_EXPERT_GGUF_NAMES, shared_expert_gate_row
from servelm.models.hf_keys import FULL, LINEAR
from servelm.models.family import Family


def _layer_types(cfg: dict, n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types:
        return tuple(types)
    interval = cfg.get("full_attention_interval", 4)
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def _partial_rotary(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25)


# GGUF blk.N.<part> -> HF names (the linear layers' parts; attention's are the usual ones).
_GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
                     "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                     "ssm_out": "linear_attn.out_proj", "ssm_ba": "linear_attn.in_proj_ba",
                     "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                     "attn_gate": "linear_attn.in_proj_z", **SHARED_EXPERT_GGUF_NAMES}


class Qwen3Next(Family):
    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    gguf_architectures = ("qwen3next",)
    gguf_layer_names = _GGUF_LAYER_NAMES
    norm_offset = 1.0
    # A GGUF's linear layers hold q | k | v and z apart: stacked into in_proj_qkvz.
    stacked = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
               "in_proj_ba": ("in_proj_b", "in_proj_a")}
    tiled_v_heads = False  # llama.cpp's qwen35 reorders value heads (see the docstring)
    # Tensor parallelism: attention's q_proj holds each head's query and gate together, so
    # its rows split two head widths a head; the DeltaNet's by the shared rules (key heads
    # and their value heads; in a qwen35 file, whose value heads are tiled, a piece a value
    # head of each key head: gguf_pieces).
    shard_rules = ((r"\.self_attn\.q_proj\.weight$", 0, "q_heads", "qgate_head"),)

    @staticmethod
    def hf_ignored(key: str) -> bool:
        """The multi-token-prediction layers (mtp.*) and a multimodal checkpoint's vision
        tower: not read."""
        return key.startswith(("mtp.", "model.visual.", "visual."))

    def hf_config(self, cfg, base):
        n = base["num_layers"]
        head_dim = base["head_dim"]
        rot = int(head_dim * _partial_rotary(cfg))
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias is not supported for hybrid Qwen models")
        out = {"qk_norm": True, "layer_types": _layer_types(cfg, n),
               "rotary_dim": rot if rot < head_dim else None,
               "extra": {"attn_output_gate": True, "linear_attn": {
                   "num_k_heads": cfg["linear_num_key_heads"],
                   "num_v_heads": cfg["linear_num_value_heads"],
                   "head_k_dim": cfg["linear_key_head_dim"],
                   "head_v_dim": cfg["linear_value_head_dim"],
                   "conv_kernel": cfg.get("linear_conv_kernel_dim", 4)}}}
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for hybrid "
                             f"Qwen models (silu only)")
        return {**out, **self._mlp(cfg, n)}

    def _mlp(self, cfg, n):
        return _qwen_moe(cfg, n, norm_topk_prob=True) if cfg.get("num_experts") else {}

    def gguf_config(self, get, base, tensor_names):
        n = base["num_layers"]
        rec = get("attention.recurrent_layers")
        interval = int(get("full_attention_interval", 4))
        types = (tuple(LINEAR if r else FULL for r in rec[:n]) if rec
                 else tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)))
        hv = int(get("ssm.time_step_rank"))
        out = {"qk_norm": True, "layer_types": types, "norm_topk_prob": True,
               "extra": {"attn_output_gate": True, "linear_attn": {
                   "num_k_heads": int(get("ssm.group_count")), "num_v_heads": hv,
                   "head_k_dim": int(get("ssm.state_size")),
                   "head_v_dim": int(get("ssm.inner_size")) // hv,
                   "conv_kernel": int(get("ssm.conv_kernel"))}}}
        if base.get("num_experts"):
            out["shared_expert_intermediate_size"] = int(
                get("expert_shared_feed_forward_length", 0))
        return out

    def gguf_name(self, gguf_name):
        # ssm_a has no .weight; ssm_dt's bias is the DeltaNet's dt_bias; attn_qkv on a
        # linear layer is its q | k | v projection (full layers have attn_q / k / v).
        m = re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias|attn_qkv\.weight)", gguf_name)
        if m:
            part = {"ssm_a": "A_log", "ssm_dt.bias": "dt_bias",
                    "attn_qkv.weight": "in_proj_qkv.weight"}[m.group(2)]
            return f"model.layers.{m.group(1)}.linear_attn.{part}"
        return super().gguf_name(gguf_name)

    def from_gguf(self, hf_name, arr, cfg, rows_of):
        gate = shared_expert_gate_row(hf_name, arr)
        if gate is not None:
            return gate
        if hf_name.endswith("linear_attn.A_log"):
            arr = np.log(-arr.astype(np.float32))  # llama.cpp stores -exp(A_log)
        elif not hf_name.endswith("linear_attn.norm.weight"):
            arr = super().from_gguf(hf_name, arr, cfg, rows_of)
        if self.tiled_v_heads and ".linear_attn." in hf_name:
            arr = _grouped_v_heads(hf_name, arr, cfg.extra["linear_attn"])
        return arr

    def gguf_pieces(self, hf_name, pieces, cfg):
        """A rank's value heads [k0 r, k1 r) (of its key heads [k0, k1)) lie in a qwen35
        file as r runs, [j hk + k0, j hk + k1) for each j < r: the value part's piece
        becomes those r pieces, so the slice read is in the tiled order from_gguf undoes."""
        lin = cfg.extra.get("linear_attn")
        value = _value_part(hf_name, lin) if self.tiled_v_heads else None
        if value is None:
            return pieces
        offset, d = value
        hk, r = lin["num_k_heads"], lin["num_v_heads"] // lin["num_k_heads"]
        dim, start, end = pieces[-1]  # the value part: the last piece (in_proj_qkv: q, k, v)
        k0, k1 = (start - offset) // (r * d), (end - offset) // (r * d)
        return [*pieces[:-1], *((dim, offset + (j * hk + k0) * d, offset + (j * hk + k1) * d)
                                for j in range(r))]

    def transform(self, name, tensor):
        if name.endswith("linear_attn.norm_weight"):
            return tensor  # the gated norm scales by w itself
        if name.endswith("linear_attn.conv_weight") and tensor.dim() == 3:
            return tensor.reshape(tensor.shape[0], tensor.shape[-1])
        return super().transform(name, tensor)

    def internal_name(self, hf_name):
        name = super().internal_name(hf_name)
        return (name.replace("linear_attn.conv1d.weight", "linear_attn.conv_weight")
                .replace("linear_attn.norm.weight", "linear_attn.norm_weight"))

    def split(self, name, tensor, cfg):
        if name.endswith("self_attn.q_proj.weight"):  # [heads, (query, gate), head_dim, in]
            t = tensor.reshape(-1, 2, cfg.head_dim, tensor.shape[-1])
            return [(name, t[:, 0].reshape(-1, tensor.shape[-1])),
                    (name.replace("q_proj", "attn_gate"), t[:, 1].reshape(-1, tensor.shape[-1]))]
        # (Only Qwen3-Next's HF checkpoints and its GGUF's ssm_ba hold these whole, per key
        # head; the others' parts are stacked.)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            return [(name, _qkvz_blocks(tensor, cfg.extra["linear_attn"]))]
        if name.endswith("linear_attn.in_proj_ba.weight"):
            return [(name, _ba_blocks(tensor, cfg.extra["linear_attn"]))]
        return [(name, tensor)]


def _value_part(hf_name: str, lin: dict | None) -> tuple[int, int] | None:
    """Where a DeltaNet tensor runs over value heads: (the offset of the value part along
    that dim, the rows a value head takes); None for the others (and where a key head has
    one value head: no tiling)."""
    if not lin or lin["num_k_heads"] == lin["num_v_heads"]:
        return None
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return 2 * lin["num_k_heads"] * lin["head_k_dim"], lin["head_v_dim"]
    if hf_name.endswith(("in_proj_z.weight", "out_proj.weight")):
        return 0, lin["head_v_dim"]
    if hf_name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return 0, 1
    return None


def _grouped_v_heads(hf_name: str, arr: np.ndarray, lin: dict) -> np.ndarray:
    """A qwen35 GGUF tensor's value heads from llama.cpp's tiled order back to key-head
    groups (transformers'), along the dim that runs over value heads. arr may be a
    tensor-parallel rank's slice (gguf_pieces): its key heads are counted from its size."""
    value = _value_part(hf_name, lin)
    if value is None:
        return arr
    qk, d = value  # (in_proj_qkv / conv1d: q and k rows before the values)
    r, dk = lin["num_v_heads"] // lin["num_k_heads"], lin["head_k_dim"]
    axis = 1 if hf_name.endswith("out_proj.weight") else 0
    a = np.moveaxis(arr, axis, 0)
    hk = a.shape[0] // (r * d + (2 * dk if qk else 0))
    at = 2 * hk * dk if qk else 0
    v = a[at:].reshape(r, hk, d, *a.shape[1:]).swapaxes(0, 1).reshape(a[at:].shape)
    return np.moveaxis(np.concatenate([a[:at], v]) if at else v, 0, axis)


def _qkvz_blocks(w: torch.Tensor, lin: dict) -> torch.Tensor:
    """Qwen3-Next's per key head [q, k, v x r, z x r] rows -> q | k | v | z."""
    hk, dk, dv = lin["num_k_heads"], lin["head_k_dim"], lin["head_v_dim"]
    r = lin["num_v_heads"] // hk
    q, k, v, z = w.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)])


def _ba_blocks(w: torch.Tensor, lin: dict) -> torch.Tensor:
    """Qwen3-Next's per key head [b x r, a x r] rows -> b | a."""
    r = lin["num_v_heads"] // lin["num_k_heads"]
    b, a = w.reshape(lin["num_k_heads"], 2 * r, -1).split([r, r], dim=1)
    return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])])


class Qwen3_5(Qwen3Next):
    """Qwen3.5: Qwen3-Next's layers with the DeltaNet's projections kept apart and a dense
    MLP (Qwen3_5ForCausalLM, or the text model of Qwen3_5ForConditionalGeneration)."""

    name = "qwen3_5"
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    gguf_architectures = ("qwen35",)
    tiled_v_heads = True

    def internal_name(self, hf_name):
        return super().internal_name(hf_name.replace("model.language_model.", "model.", 1))

    def _mlp(self, cfg, n):
        return {}


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5-MoE: Qwen3.5's layers with Qwen3-Next's MoE on every layer (the chosen
    experts' weights always renormalised)."""

    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    gguf_architectures = ("qwen35moe",)

    def _mlp(self, cfg, n):
        return {**_qwen_moe(cfg, n, norm_topk_prob=True), "norm_topk_prob": True}
