"""Tensor parallelism on CPU: TP=2 (one thread per rank) against TP=1 (two threads).

Decode throughput at batch 1 and batch 16, TP=2 with its collectives through shared memory
(the default on one host) and through gloo (--no-shm-collectives), side by side; the
collectives of one step (counted on rank 0), what one all-reduce costs here each way (two
processes), and what the same bytes would cost on NVLink and on 100 Gb/s Ethernet.

    .venv/bin/python benchmarks/tensor_parallel.py [--dtype float32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from servelm import LLM, SamplingParams

NVLINK = 450e9        # bytes/s per direction, H100/H200 NVLink 4 (900 GB/s bidirectional)
ETHERNET = 100e9 / 8  # 100 Gb/s


def decode_rate(llm: LLM, batch: int, tokens: int) -> tuple[float, dict]:
    """Decode tokens/s of `batch` sequences (decode-only steps), and rank 0's collectives."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Request {i}: tell me a long story about the sea." for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    group = getattr(engine.executor, "group", None)
    s0 = engine.stats
    secs0, toks0, steps0 = s0.decode_seconds, s0.num_decode_tokens, s0.num_steps
    ar0 = (group.num_all_reduces, group.all_reduce_bytes) if group else (0, 0)
    llm.generate(prompts, params, use_tqdm=False)
    s = engine.stats
    steps = s.num_steps - steps0
    comm = {}
    if group:  # the count is the same every step; decode steps carry one token per sequence
        per_step = (group.num_all_reduces - ar0[0]) / steps
        elem = torch.empty(0, dtype=engine.dtype).element_size()
        comm = {"all_reduces_per_step": per_step,
                "bytes_per_step": per_step * batch * engine.model_config.hidden_size * elem,
                # rank 0 gathers every other rank's fp32 logits block for the sampler
                "gather_bytes": batch * engine.executor.plan.vocab_per_rank * 4 * (group.world - 1)}
    return (s.num_decode_tokens - toks0) / (s.decode_seconds - secs0), comm


def _allreduce_worker(rank: int, port: int, sizes: list[int], iters: int, shm: bool) -> None:
    from torch.distributed import TCPStore

    from servelm.distributed.parallel_state import TPGroup

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, is_master=False, wait_for_workers=False)
    group = TPGroup(store, rank, 2, torch.device("cpu"), hostname="127.0.0.1", shm=shm)
    for n in sizes:
        t = torch.ones(n)
        for _ in range(iters // 10):
            group.all_reduce(t)
        for _ in range(iters):
            group.all_reduce(t)


def allreduce_latency(sizes: list[int], shm: bool, iters: int = 500) -> dict[int, float]:
    """Seconds per all-reduce of n fp32 values between two processes on this host (shared
    memory, or gloo on loopback)."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    from servelm.distributed.parallel_state import TPGroup

    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    p = mp.get_context("spawn").Process(target=_allreduce_worker,
                                        args=(1, store.port, sizes, iters, shm))
    p.start()
    group = TPGroup(store, 0, 2, torch.device("cpu"), hostname="127.0.0.1", shm=shm)
    out = {}
    for n in sizes:
        t = torch.ones(n)
        for _ in range(iters // 10):
            group.all_reduce(t)
        t0 = time.perf_counter()
        for _ in range(iters):
            group.all_reduce(t)
        out[n] = (time.perf_counter() - t0) / iters
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(dtype=args.dtype, kv_cache_memory=256 << 20, num_threads=2)
    results = {}
    runs = [(1, True), (2, False), (2, True)]  # (tp, shared-memory collectives)
    for tp, shm in runs:
        llm = LLM(**kw, tensor_parallel_size=tp, shm_collectives=shm)
        hidden = llm.engine.model_config.hidden_size
        elem = torch.empty(0, dtype=llm.engine.dtype).element_size()
        for b in batches:
            results[tp, shm, b] = decode_rate(llm, b, args.tokens)
            how = "" if tp == 1 else (" shm " if shm else " gloo")
            print(f"TP={tp}{how} ({2 // tp} thread{'s' if tp == 1 else ''}/rank) batch {b:>3}: "
                  f"{results[tp, shm, b][0]:7.1f} tok/s", flush=True)
        llm.engine.shutdown()
        del llm
    lat = {shm: allreduce_latency([hidden * b for b in batches], shm) for shm in (False, True)}
    print(f"\n{'batch':>5} {'TP=1 tok/s':>10} {'TP=2 gloo':>10} {'TP=2 shm':>10} "
          f"{'all-reduces':>11} {'AR bytes':>10} {'gloo here':>10} {'shm here':>10} "
          f"{'NVLink':>9} {'100GbE':>9} {'gather':>9}")
    for b in batches:
        comm = results[2, True, b][1]
        n_ar, nbytes = comm["all_reduces_per_step"], comm["bytes_per_step"]
        # Ring all-reduce over N ranks: each rank sends and receives 2 (N-1)/N of the bytes.
        moved = nbytes * 2 * (2 - 1) / 2
        print(f"{b:>5} {results[1, True, b][0]:>10.1f} {results[2, False, b][0]:>10.1f} "
              f"{results[2, True, b][0]:>10.1f} {n_ar:>11.0f} {nbytes / 1024:>8.1f}Ki "
              f"{n_ar * lat[False][hidden * b] * 1e3:>8.2f}ms "
              f"{n_ar * lat[True][hidden * b] * 1e3:>8.2f}ms "
              f"{moved / NVLINK * 1e6:>7.2f}us {moved / ETHERNET * 1e6:>7.1f}us "
              f"{comm['gather_bytes'] / 1024:>7.1f}Ki")
    print(f"\n{args.dtype}: one all-reduce of one token's hidden state is {hidden * elem} bytes; "
          f"one all-reduce here, gloo on loopback / shared memory: "
          f"{lat[False][hidden] * 1e6:.0f} / {lat[True][hidden] * 1e6:.0f} us (batch 1), "
          f"{lat[False][hidden * batches[-1]] * 1e6:.0f} / "
          f"{lat[True][hidden * batches[-1]] * 1e6:.0f} us (batch {batches[-1]}); the "
          f"'here' columns are a step's all-reduces at those latencies. 'gather' is the "
          f"fp32 logits rank 0 receives per decode step. NVLink and "
          f"Ethernet columns are bandwidth only; add each link's per-collective latency "
          f"(a few us for NCCL on NVLink, tens of us over TCP) times the all-reduce count.")


if __name__ == "__main__":
    main()
