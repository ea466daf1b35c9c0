"""Attention backends: each says whether it can run a configuration, builds its own per-step
metadata from the scheduled sequences, and attends one layer over the paged KV cache.

    reference  gather + SDPA (servelm.attention.reference): the eager fp32 reference, any
               device, KV dtype, head dim and sliding window
    cpu        servelm's C++ kernels (servelm.attention.cpu): ragged decode and flash-style
               prompt attention in place over the block tables (fp32/bf16/fp16/int8 caches)
    triton     CUDA Triton kernels (servelm.attention.triton), in place over the block tables

The backend is chosen once, at start-up (`select`, from KernelConfig.attention_backend);
the step's ForwardBatch carries its metadata, and with it the backend, to every layer.
"""

from __future__ import annotations

from servelm.attention.backend import AttentionBackend, AttentionSpec
from servelm.attention.cpu import CpuBackend
from servelm.attention.metadata import AttentionMetadata, AttnGroup, RaggedDecodes
from servelm.attention.reference import ReferenceBackend
from servelm.attention.triton import TritonBackend

BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (ReferenceBackend(), CpuBackend(), TritonBackend())}


def get_backend(name: str) -> AttentionBackend:
    return BACKENDS[name]


def select(kernels, spec: AttentionSpec) -> AttentionBackend:
    """The backend for `spec` from a KernelConfig: its attention_backend, or for "auto" the
    C++ kernels on the CPU (cpu_kernels on, and they read this cache and are built), else
    Triton on CUDA (triton_attention on, and its kernels pass their probe on this shape),
    else the reference. An explicit backend that cannot run `spec` is a ValueError."""
    name = kernels.attention_backend
    if name != "auto":
        backend = BACKENDS[name]
        reason = backend.unsupported(spec)
        if reason is not None:
            raise ValueError(f"attention_backend {name!r} cannot run this configuration: "
                             f"{reason}")
        return backend
    if kernels.cpu_kernels and BACKENDS["cpu"].unsupported(spec) is None:
        return BACKENDS["cpu"]
    if kernels.triton_attention and BACKENDS["triton"].unsupported(spec) is None:
        return BACKENDS["triton"]
    return BACKENDS["reference"]


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "AttnGroup", "BACKENDS",
           "RaggedDecodes", "get_backend", "select"]
