"""PoolingParams: how a pooling (embedding) request's vector is made, validated (no torch).

A pooling request runs its prompt through the model like any prompt (chunked prefill, the
token budget, admission control) and is never sampled: at its last prompt chunk the final
hidden states are pooled into one vector (the model's pooling: last token, mean or first),
truncated to `dimensions` and L2-normalised as asked."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams, for embeddings.

    dimensions: keep the first `dimensions` values (Matryoshka embeddings): only for a model
    that says it was trained for it, or the model's own width; None keeps them all.
    normalize: L2-normalise the vector (after truncation, as sentence-transformers does);
    None: the model's default (see LLMEngine.pooling_config)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null, got {self.normalize!r}")

    @property
    def n(self) -> int:
        """Sequences the request becomes (one: pooling has no samples)."""
        return 1
