"""Process-wide state, set once by a process's entry (the CLI, `LLM(...)`, `python -m
servelm.kernels`), never by the engine or the layers it builds:

    init_process(config)   before the engine is built: torch's intra-op threads, the
                           interpreter's bin directory on PATH (ninja, for the C++ kernels'
                           builds), SERVELM_NO_KERNELS read (the kernels never read the
                           environment again)
    finish_startup()       after it is built: what start-up allocated moved out of the
                           garbage collector's way

A tensor-parallel rank's own threads are its start-up's (servelm.distributed).
"""

from __future__ import annotations

import gc
import os

import torch

from servelm import kernels


def physical_cores() -> int:
    """Physical cores this process may run on: hyper-threads of one core share its vector
    units, so matmul threads beyond one per core only contend."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            cores.add(("?", str(cpu)))  # no topology: count each CPU as a core
    return max(1, len(cores))


def resolve_device(name: str) -> torch.device:
    """An engine's device option (EngineConfig.device): auto is CUDA where it is available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return torch.device(name)


def init_process(config=None) -> None:
    """Before an engine is built (config: its EngineConfig; None: the defaults). Idempotent:
    a second call (a second engine in one process) sets the same state again.

    Threads: config.num_threads, else on the CPU one intra-op thread per physical core
    (torch may count hyper-threads); on a GPU torch's own count unless one was given."""
    num_threads = getattr(config, "num_threads", None)
    device = getattr(config, "device", "auto")
    if num_threads or resolve_device(device).type == "cpu":
        torch.set_num_threads(num_threads or physical_cores())
    kernels.prepare()


def finish_startup() -> None:
    """After the engine is built: everything allocated so far lives as long as the engine
    (vocabulary, weights' wrappers), so it moves out of the collector's way, and a full
    collection during serving does not walk it and stall a step."""
    gc.collect()
    gc.freeze()
