"""The model contract: what one family file declares.

A family is the generic decoder (servelm/models/decoder.py, built from the shared blocks in
layers.py and moe.py) plus this description: which architecture names it answers to (HF
`architectures`, GGUF `general.architecture`), the config keys only it has, how its
checkpoints name their tensors, and what it supports. Quantisation, the tuned linear
methods, the C++ and Triton attention, CUDA graphs and tensor parallelism act on the shared
blocks, so a family adds no code to any of them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import numpy as np
import torch

# GGUF tensor names (blk.N.<part>) -> HF names, as llama.cpp names Llama-shaped layers.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

Getter = Callable[[str, Any], Any]


class Family:
    """One model family. Subclasses set the class attributes and override the hooks."""

    name = "llama"
    architectures: tuple[str, ...] = ()       # HF names; the first is the canonical one
    gguf_architectures: tuple[str, ...] = ()  # llama.cpp's names
    # Checkpoint (HF) name components -> the decoder's own, in one pass (no chaining).
    renames: dict[str, str] = {}
    # GGUF blk.N.<part> names this family spells differently from GGUF_LAYER_NAMES.
    gguf_layer_names: dict[str, str] = {}
    gguf_permute_qk = False      # llama.cpp permuted q/k rows for its rotary (llama only)
    norm_offset = 0.0            # the checkpoint stores w, the model scales by offset + w
    tensor_parallel = True       # shard_model can split it
    # Decoder parameters stacked from several checkpoint tensors, beyond qkv_proj and
    # gate_up_proj (CausalLM._STACKED): fused name -> the parts in row order.
    stacked: dict[str, tuple[str, ...]] = {}

    # Tensor parallelism: (name pattern, dim, range, unit) rules for tensors this family lays
    # out its own way (every checkpoint's; an HF checkpoint's only), consulted before
    # ShardPlan's shared ones.
    shard_rules: tuple = ()
    hf_shard_rules: tuple = ()

    def require_tensor_parallel(self) -> None:
        """ValueError unless shard_model can split this family (from HF or GGUF files)."""
        if not self.tensor_parallel:
            raise ValueError(f"tensor parallelism does not support the {self.name} "
                             f"family yet (run it with tensor_parallel_size 1)")

    def hf_config(self, cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields beyond the common ones, from config.json."""
        return {}

    def hf_text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """A multimodal checkpoint's config.json (Llama4ForConditionalGeneration,
        Gemma4ForConditionalGeneration...) -> its text model's (text_config), with the
        checkpoint's architecture name; a text model's own config as it is. The loader reads
        it where a config has a text_config."""
        text = cfg.get("text_config")
        if not text:
            return cfg
        return {**text, "architectures": cfg.get("architectures") or [self.architectures[0]]}

    def gguf_config(self, get: Getter, base: dict[str, Any], tensor_names: set[str]
                    ) -> dict[str, Any]:
        """ModelConfig fields beyond the common ones, from GGUF metadata (get(key, default)
        reads '<arch>.<key>')."""
        return {}

    def gguf_pieces(self, hf_name: str, pieces: list[tuple[int, int, int]], cfg
                    ) -> list[tuple[int, int, int]]:
        """A tensor-parallel rank's pieces (dim, start, end) of a tensor, given in the HF
        checkpoint's order, as the GGUF file holds them (where llama.cpp's converter
        reordered rows: qwen35's tiled value heads); read and joined in order, they make the
        rank's slice in the file's order, which from_gguf then puts in the HF order."""
        return pieces

    def gguf_rope_freqs(self, cfg, factors: tuple[float, ...]):
        """The config with a GGUF's rope_freqs tensor read in: Llama 3.1+'s rope scaling, one
        divisor per frequency."""
        return dataclasses.replace(cfg, rope_scaling={"rope_type": "freq_factors",
                                                      "factors": factors})

    # ---- names and values -----------------------------------------------------------------

    def gguf_name(self, gguf_name: str) -> str | None:
        """A GGUF tensor's HF name, None for one this family does not know."""
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
        if m:
            part = self.gguf_layer_names.get(m.group(2)) or GGUF_LAYER_NAMES.get(m.group(2))
            return part and f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
        base, _, kind = gguf_name.rpartition(".")
        part = GGUF_GLOBAL_NAMES.get(base)
        return part and f"{part}.{kind}"

    def from_gguf(self, hf_name: str, arr: np.ndarray, cfg, rows_of: int) -> np.ndarray:
        """A GGUF tensor in the HF checkpoint's convention. rows_of: the tensor's full row
        count (a tensor-parallel slice holds fewer, in whole heads)."""
        if self.gguf_permute_qk:
            if ".q_proj." in hf_name:
                return _unpermute(arr, cfg.num_heads * arr.shape[0] // rows_of)
            if ".k_proj." in hf_name:
                return _unpermute(arr, cfg.num_kv_heads * arr.shape[0] // rows_of)
        if self.norm_offset and hf_name.endswith("norm.weight"):
            return arr - np.float32(self.norm_offset)  # llama.cpp stored offset + w
        return arr

    def internal_name(self, hf_name: str) -> str:
        """The decoder's parameter name for a checkpoint tensor (HF spelling)."""
        name = hf_name.removeprefix("model.")
        if self.renames:
            name = _rename_re(tuple(self.renames)).sub(lambda m: self.renames[m.group(0)], name)
        return name

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (decoder name) as the decoder holds it."""
        if self.norm_offset and name.endswith("norm.weight"):
            return tensor.float() + self.norm_offset
        return tensor

    def transform_mxfp4(self, name: str, w):
        """A checkpoint's MXFP4 routed experts (servelm.quantization.mxfp4.MXFP4Weight,
        [E, out, in], decoder name) with their rows in the decoder's order (gate rows, then
        up): as they are, unless the family's checkpoint orders them otherwise."""
        return w

    def split(self, name: str, tensor: torch.Tensor, cfg) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor (decoder name, transformed) as the decoder parameters it
        fills (cfg: the model's ModelConfig): itself, unless one tensor holds two of the
        decoder's (Qwen3-Next's q_proj: the queries and the output gate) or its rows in
        another order."""
        return [(name, tensor)]


_RENAME_CACHE: dict[tuple[str, ...], re.Pattern] = {}


def _rename_re(keys: tuple[str, ...]) -> re.Pattern:
    if keys not in _RENAME_CACHE:
        _RENAME_CACHE[keys] = re.compile(r"(?<=\.)(" + "|".join(map(re.escape, keys)) + r")(?=\.)")
    return _RENAME_CACHE[keys]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permute, which interleaves each head's two rotary halves."""
    rows = w.shape[0]
    w2 = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return w2.swapaxes(1, 2).reshape(w.shape)
