"""Attention backends: each says whether it can run a configuration, builds its own per-step
metadata from the scheduled sequences, and attends one layer over the paged KV cache.

    reference  gather + SDPA (servelm.attention.reference): the eager fp32 reference, any
               device, KV dtype, head dim, sliding window and attention chunk
    cpu        servelm's C++ kernels (servelm.attention.cpu): ragged decode and flash-style
               prompt attention in place over the block tables (fp32/bf16/fp16/int8 caches)
    cpu_sdpa   the cpu backend with prompt chunks on PyTorch's CPU flash attention (AMX's
               brgemm where the CPU has it)
    cpu_amx    the cpu backend with bf16 prompt chunks on servelm's AMX tile kernel;
               "auto" times the cpu prompt paths this machine runs at start-up
    triton     CUDA Triton kernels (servelm.attention.triton), in place over the block tables

The backend is chosen once, at start-up (`select`, from KernelConfig.attention_backend);
the step's ForwardBatch (metadata.py) carries its metadata, and with it the backend, to
every layer.
"""

from __future__ import annotations

import logging
import math

import torch

from servelm.attention.backend import AttentionBackend, AttentionSpec
from servelm.attention.cpu import (PROMPT_TOKENS, CpuAmxBackend, CpuBackend, CpuSdpaBackend,
                                  shape_unsupported, time_prompt)
from servelm.attention.metadata import AttentionMetadata, AttnGroup, ForwardBatch, RaggedDecodes
from servelm.attention.reference import ReferenceBackend
from servelm.attention.triton import TritonBackend

BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (ReferenceBackend(), CpuBackend(), CpuSdpaBackend(), CpuAmxBackend(),
                        TritonBackend())}
logger = logging.getLogger(__name__)


# The cpu backends "auto" chooses among by timing their prompt attention.
CPU_PROMPT_PATHS = ("cpu", "cpu_sdpa", "cpu_amx")


def get_backend(name: str) -> AttentionBackend:
    return BACKENDS[name]


def select(kernels, spec: AttentionSpec) -> AttentionBackend:
    """The backend for `spec` from a KernelConfig: its attention_backend, or for "auto" the
    C++ kernels on the CPU (cpu_kernels on, and they read this cache and are built), with
    prompts on whichever of servelm's op, PyTorch's flash attention and servelm's AMX
    kernel measures fastest here (cpu, cpu_sdpa or cpu_amx, of those that run this spec;
    kernel tuning off: cpu), else Triton on CUDA (triton_attention on, and its kernels pass
    their probe on this shape), else the reference. An explicit backend that cannot run
    `spec` is a ValueError."""
    name = kernels.attention_backend
    if name != "auto":
        backend = BACKENDS[name]
        reason = backend.unsupported(spec)
        if reason is not None:
            raise ValueError(f"attention_backend {name!r} cannot run this configuration: "
                             f"{reason}")
        return backend
    if kernels.cpu_kernels and BACKENDS["cpu"].unsupported(spec) is None:
        names = [n for n in CPU_PROMPT_PATHS if BACKENDS[n].unsupported(spec) is None]
        if kernels.tuning != "off" and spec.kv_dtype == spec.dtype and len(names) > 1:
            return _measured_cpu_backend(kernels, spec, names)
        return BACKENDS["cpu"]
    if kernels.triton_attention and BACKENDS["triton"].unsupported(spec) is None:
        return BACKENDS["triton"]
    # A model option a backend's kernels lack (AttentionBackend.options) or a shape they
    # do not take (a head past 576 dims on the CPU) keeps it on the reference: say so once.
    fast = "cpu" if spec.device.type == "cpu" else "triton"
    shape = fast == "cpu" and shape_unsupported(spec)
    if ((spec.kernels_lack(BACKENDS[fast].options) or shape)
            and (kernels.cpu_kernels if fast == "cpu" else kernels.triton_attention)):
        logger.info("attention backend reference, not %s: %s", fast,
                    BACKENDS[fast].unsupported(spec))
    return BACKENDS["reference"]


def _measured_cpu_backend(kernels, spec: AttentionSpec, names: list[str]) -> AttentionBackend:
    """The one of `names` (cpu backends) whose prompt path took least time over
    time_prompt's chunks, measured once per machine key and shape (the linear methods'
    cache); a cached entry that lacks one of them is measured again."""
    from servelm.tuning_cache import TuningCache, cache_dir, machine_key, times_from

    cache = TuningCache(cache_dir(kernels.tuning_cache_dir),
                        machine_key(torch.get_num_threads()))
    key = (f"attention/prompt:{str(spec.dtype).removeprefix('torch.')}:{spec.num_heads}x"
           f"{spec.num_kv_heads}x{spec.head_dim}:block{spec.block_size}")
    entry = None if kernels.tuning == "fresh" else cache.get(key)
    if entry is None or not set(names) <= set(times_from(entry)):
        cache.put(key, time_prompt([BACKENDS[n] for n in names], spec), [], [], names)
        cache.save()
        entry = cache.get(key)
    times = times_from(entry)
    best = min(names, key=lambda n: sum(times.get(n, [math.inf])))
    logger.info("prompt attention (µs at %s tokens): %s -> %s", "/".join(
        map(str, PROMPT_TOKENS)), ", ".join(
        f"{n} {'/'.join(f'{t:.0f}' for t in times.get(n, []))}" for n in names), best)
    return BACKENDS[best]


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "AttnGroup", "BACKENDS",
           "ForwardBatch", "RaggedDecodes", "get_backend", "select"]
