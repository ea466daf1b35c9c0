"""KV-cache dtypes side by side in one process: engines with the same KV pool bytes (or the
bytes a bf16 pool of the same capacity would take), all 64 requests submitted at once, the
engines' steps interleaved one by one so each sees the same machine load.

`benchmarks/serving.py kv-dtype` runs the same comparison through servers and 64 HTTP
clients; on a machine other agents load heavily, those runs (one after another, minutes
each) drift too much to compare, and this one does not: a step of each engine in turn,
each step's time charged to its engine.

    python benchmarks/kv_dtype_ab.py [--requests 64] [--input-len 128] [--output-len 128]
                                     [--pool-seqs 20] [--num-threads N]

Cases: the model dtype in the bytes that hold as many sequences as a bf16 pool of
--pool-seqs (on a CPU running fp32: twice the bf16 bytes); int8 in the bf16 pool's bytes;
and, when the model dtype is not 16-bit, the model dtype in those same bytes. Reported: the
most sequences running at once, output tok/s over the engine's own step time, and each
case's ratios to the first.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from servelm import LLM, SamplingParams
from servelm.cli import positive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=positive(int), default=64)
    ap.add_argument("--input-len", type=positive(int), default=128)
    ap.add_argument("--output-len", type=positive(int), default=128)
    ap.add_argument("--pool-seqs", type=positive(int), default=20,
                    help="sequences (input + output tokens) a bf16 pool of the bytes holds")
    ap.add_argument("--num-threads", type=positive(int), default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    probe = LLM(dtype=args.dtype, kv_cache_memory=1 << 20, num_threads=args.num_threads,
                kernel_tuning="off")
    eng = probe.engine
    cfg, bs = eng.model_config, eng.executor.kv_cache.block_size
    blocks = -(-(args.input_len + args.output_len) // bs)
    bf16_block = 2 * cfg.num_layers * bs * cfg.num_kv_heads * cfg.head_dim * 2
    pool = args.pool_seqs * blocks * bf16_block
    elem = torch.empty(0, dtype=eng.dtype).element_size()
    dname = str(eng.dtype).removeprefix("torch.")
    del probe, eng
    cases = [(f"{dname}, bf16-sized pool", dict(kv_cache_memory=pool * elem // 2)),
             ("int8, same bytes", dict(kv_cache_memory=pool, kv_cache_dtype="int8"))]
    if elem != 2:
        cases.append((f"{dname}, same bytes", dict(kv_cache_memory=pool)))
    print(f"pool {pool / 2**20:.1f} MiB (bf16: {args.pool_seqs} sequences of "
          f"{args.input_len} + {args.output_len} tokens); {args.requests} requests at once; "
          f"model dtype {dname}", flush=True)

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = run_interleaved(
        [(name, LLM(dtype=args.dtype, num_threads=args.num_threads, kernel_tuning="cached",
                    enable_prefix_caching=False, **kw)) for name, kw in cases], prompts, sp)
    base = None
    for name, llm, seconds, max_running in engines:
        nblocks = llm.engine.executor.kv_cache.num_blocks
        tps = args.requests * args.output_len / seconds
        base = base or (max_running, tps)
        print(f"{name:<26} blocks {nblocks:>5}  max running {max_running:>3}  "
              f"{tps:8.1f} output tok/s  ({seconds:.1f} s of steps)  ratio: running "
              f"{max_running / base[0]:.2f}x, throughput {tps / base[1]:.2f}x", flush=True)


def run_interleaved(engines: list[tuple[str, LLM]], prompts: list[list[int]],
                    sp: SamplingParams) -> list[tuple[str, LLM, float, int]]:
    """Every prompt submitted to each engine at once, then the engines' steps interleaved
    one by one until all are done: (name, LLM, seconds of its own steps, most sequences
    running at once) per engine."""
    rows = []
    for name, llm in engines:
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", None, sp, prompt_token_ids=p)
        rows.append([name, llm, 0.0, 0])
    active = list(rows)
    while active:
        for row in list(active):
            e = row[1].engine
            t0 = time.perf_counter()
            e.step()
            row[2] += time.perf_counter() - t0
            row[3] = max(row[3], e.scheduler.num_running)
            if not e.has_unfinished_requests():
                active.remove(row)
    return [tuple(r) for r in rows]


if __name__ == "__main__":
    main()
