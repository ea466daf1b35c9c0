"""A hybrid model's KV pool in block groups against one block table, side by side in one
process: engines with the same KV pool bytes, all requests submitted at once, the engines'
steps interleaved one by one so each sees the same machine load (as kv_dtype_ab.py).

A hybrid model (sliding-window and full-attention layers: Gemma 2/3/4, gpt-oss, Llama 4,
EXAONE 4, OLMo 3...) keeps in block groups (the default) only the window's keys of its
sliding layers; with one table (--no-hybrid-kv-cache) every layer keeps every key. With
prompts longer than the window the groups hold more sequences in the same bytes.

    python benchmarks/hybrid_kv_ab.py [--model PATH] [--requests 32] [--input-len 1536]
                                      [--output-len 128] [--pool-seqs 8]
                                      [--max-num-batched-tokens 512] [--num-threads N]

--model defaults to Gemma-3-270M (scripts/fetch_models.py gemma3-270m: window 512, one
global layer in six). Reported per engine: its pool's blocks (pages in groups), the most
sequences running at once, output tok/s over its own step time, preemptions, and each
ratio to one table's.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import sys

from servelm import LLM, SamplingParams
from servelm.cli import positive

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kv_dtype_ab import run_interleaved  # noqa: E402  (the engines' steps interleaved)


def default_model() -> str:
    spec = importlib.util.spec_from_file_location(
        "fetch_models", pathlib.Path(__file__).parent.parent / "scripts" / "fetch_models.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    path = fetch.model_path("gemma3-270m")
    if not path.is_file():
        raise SystemExit("no --model and Gemma-3-270M is not fetched: "
                         "python scripts/fetch_models.py gemma3-270m")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=positive(int), default=32)
    ap.add_argument("--input-len", type=positive(int), default=1536)
    ap.add_argument("--output-len", type=positive(int), default=128)
    ap.add_argument("--pool-seqs", type=positive(int), default=8,
                    help="sequences (input + output tokens) one table of the pool's bytes holds")
    ap.add_argument("--max-num-batched-tokens", type=positive(int), default=512)
    ap.add_argument("--num-threads", type=positive(int), default=None)
    args = ap.parse_args()
    model = args.model or default_model()
    common = dict(model=model, num_threads=args.num_threads, kernel_tuning="cached",
                  enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.input_len + args.output_len)

    probe = LLM(**common, kv_cache_memory=64 << 20, hybrid_kv_cache=False)
    eng = probe.engine
    groups = eng.model_config.kv_groups
    if groups is None:
        raise SystemExit(f"{model}: not a hybrid model (sliding-window and full-attention "
                         f"layers): nothing to compare")
    bs = eng.executor.kv_cache.block_size
    blocks = -(-(args.input_len + args.output_len) // bs)
    pool = args.pool_seqs * blocks * eng.executor.block_bytes
    del probe, eng
    sizes = "/".join(str(len(g)) for g in groups.layers)
    print(f"{model}: {len(groups.layers)} block groups of {sizes} layers (reaches "
          f"{', '.join(map(str, groups.reaches))}); pool {pool / 2**20:.1f} MiB (one table: "
          f"{args.pool_seqs} sequences of {args.input_len} + {args.output_len} tokens); "
          f"{args.requests} requests at once", flush=True)

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = run_interleaved(
        [(name, LLM(**common, kv_cache_memory=pool, hybrid_kv_cache=hybrid))
         for name, hybrid in (("one table", False), ("block groups", True))], prompts, sp)
    base = None
    for name, llm, seconds, max_running in engines:
        nblocks = llm.engine.block_manager.num_blocks
        tps = args.requests * args.output_len / seconds
        base = base or (max_running, tps)
        print(f"{name:<13} blocks {nblocks:>6}  max running {max_running:>3}  "
              f"{tps:8.1f} output tok/s  ({seconds:.1f} s of steps, "
              f"{llm.engine.scheduler.num_preemptions} preemptions)  ratio: running "
              f"{max_running / base[0]:.2f}x, throughput {tps / base[1]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
