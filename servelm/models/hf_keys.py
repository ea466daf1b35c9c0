"""The HF config keys that ModelConfig and the family files (families/) both read: the
attention kind of each layer, the rotary base and scaling (transformers 4's and 5's
spellings). Below config.py and the registry, so a family imports them without importing
either."""

from __future__ import annotations

from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
# A linear-attention layer (Qwen3-Next, Qwen3.5): a recurrent state per sequence, no KV.
LINEAR = "linear_attention"


def window_pattern(pattern, n: int) -> tuple[str, ...]:
    """Each of n layers' kind from a sliding-window pattern, as configs and GGUF files state
    it: a period (every pattern-th layer global), a string ("LLLG", repeating from layer 0)
    or a bool a layer (true: sliding)."""
    if isinstance(pattern, str):
        return tuple(SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n))
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {n} layers")
        return tuple(SLIDING if p else FULL for p in pattern)
    return tuple(FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n))


def rope_theta(cfg: dict[str, Any], layer_type: str = FULL) -> float:
    """HF keeps the base in rope_theta (transformers 4) or rope_parameters (5), which may be
    split per layer type (Gemma 3: full_attention / sliding_attention)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:
        params = params[layer_type]
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def rope_scaling(cfg: dict[str, Any], layer_type: str = FULL) -> dict[str, Any] | None:
    """HF keeps scaling in rope_scaling (transformers 4) or rope_parameters (5)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling and layer_type in scaling:
        scaling = scaling[layer_type]
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "yarn", "proportional"):
        raise ValueError(f"unsupported rope scaling {kind!r} "
                         f"(supported: linear, llama3, yarn, proportional)")
    out = {**scaling, "rope_type": kind}
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if out.get("factor") is None:
            out["factor"] = cfg["max_position_embeddings"] / out["original_max_position_embeddings"]
    return out


def hf_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """The per-layer attention kinds a HF config states (layer_types, or one sliding_window
    for every layer, as Mistral's), or () when every layer attends to everything."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ()
    types = tuple(cfg.get("layer_types") or (SLIDING,) * num_layers)
    if window >= cfg.get("max_position_embeddings", 1 << 62):
        types = (FULL,) * num_layers  # a window as long as the context is no window
    return () if SLIDING not in types else types
