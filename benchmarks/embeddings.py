"""Embedding throughput beside generation's prefill, one engine, alternating in one run.

    python benchmarks/embeddings.py [--num-texts 64] [--rounds 3] [--model FILE] [--dtype D]

The same short texts are embedded (LLM.embed: one pooled vector each, no token sampled) and
prefilled for one generated token (LLM.generate with max_tokens=1, prefix caching off so each
round computes every prompt): both run the same scheduler and prefill path, so their
prompt-token rates should agree, and inputs/s says what a RAG indexer gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from servelm import LLM, PoolingParams, SamplingParams

TEXTS = ["The KV cache stores the keys and values of earlier tokens.",
         "Paris is the capital of France.", "Prime numbers have exactly two divisors.",
         "A violin has four strings.", "Bread rises because yeast makes gas.",
         "The moon orbits the earth about once a month.", "Autumn leaves turn red and gold.",
         "A chess game starts with sixteen pieces a side."]


def texts(n: int) -> list[str]:
    return [f"{TEXTS[i % len(TEXTS)]} (note {i})" for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-texts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              kv_cache_memory=256 << 20)
    batch = texts(args.num_texts)
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in batch)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.embed(batch[:4], PoolingParams(), use_tqdm=False)  # warm-up, both paths
    llm.generate(batch[:4], one, use_tqdm=False)
    runs: dict[str, list[float]] = {"embed": [], "prefill": []}
    for _ in range(args.rounds):  # alternating: a drifting machine hits both sides alike
        t = time.perf_counter()
        out = llm.embed(batch, use_tqdm=False)
        runs["embed"].append(time.perf_counter() - t)
        assert len(out) == len(batch) and out[0].outputs.embedding
        t = time.perf_counter()
        llm.generate(batch, one, use_tqdm=False)
        runs["prefill"].append(time.perf_counter() - t)
    report = {"texts": len(batch), "prompt_tokens": tokens,
              "weights": llm.engine.weight_format,
              "dtype": str(llm.engine.dtype).removeprefix("torch.")}
    for side, secs in runs.items():
        med = statistics.median(secs)
        report[side] = {"seconds": secs, "inputs_per_s": len(batch) / med,
                        "prompt_tokens_per_s": tokens / med}
    report["embed_over_prefill"] = (report["embed"]["prompt_tokens_per_s"]
                                    / report["prefill"]["prompt_tokens_per_s"])
    print(f"{len(batch)} texts, {tokens} prompt tokens, weights {report['weights']}, "
          f"{report['dtype']}")
    for side in runs:
        r = report[side]
        print(f"  {side:<8} {r['inputs_per_s']:8.1f} inputs/s  {r['prompt_tokens_per_s']:9.0f} "
              f"prompt tokens/s  (rounds: {', '.join(f'{s:.3f}' for s in r['seconds'])} s)")
    print(f"  embed / prefill prompt-token rate: {report['embed_over_prefill']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
