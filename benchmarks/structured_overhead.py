"""Structured outputs' cost: TPOT of N concurrent json_schema streams against N unconstrained
ones on the same server, alternating (constrained first, then unconstrained, then the other
order) round by round so that drift on a shared machine falls on both; the ratio is taken
within each round. Then the compile time of a typical schema: the tokenizer's one-time
conversion for llguidance, a cold compile, and a cached one.

    python benchmarks/structured_overhead.py [--concurrency 16] [--output-len 64] [--rounds 3]
        [--base-url URL | --server-flags "--dtype float32"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time

import httpx

from serving import Server  # benchmarks/serving.py, beside this file
from servelm.bench.client import send_request
from servelm.bench.datasets import BenchPrompt

# Cannot be complete before max_tokens: at least 64 strings, so every stream runs to length.
LONG_SCHEMA = {"type": "object", "required": ["notes"], "properties": {
    "notes": {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 48}}}}

# A typical schema: nested objects, an enum, a bounded array, a pattern, a union.
TYPICAL_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "email", "role", "address", "tags", "manager"],
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "email": {"type": "string", "pattern": r"^[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,4}$"},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}}},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "manager": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    }}


async def phase(url: str, model: str, n: int, output_len: int, constrained: bool) -> list[float]:
    """n streams at once; each one's TPOT (s)."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "notes", "schema": LONG_SCHEMA}}
    prompts = [f"Write note {i} about the paged KV cache, as JSON." for i in range(n)]
    async with httpx.AsyncClient(timeout=600) as client:
        recs = await asyncio.gather(*(
            send_request(client, f"{url}/v1/chat/completions",
                         {**body, "messages": [{"role": "user", "content": p}]}, i,
                         BenchPrompt(p, None, output_len))
            for i, p in enumerate(prompts)))
    failed = [r.error for r in recs if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return [r.tpot for r in recs if r.tpot is not None]


def compile_times(model_path: str | None) -> dict[str, float]:
    """Seconds: llguidance's tokenizer (once per engine), a cold compile, a cached one, and a
    per-sample matcher copy."""
    from servelm.models.loader import open_checkpoint
    from servelm.structured_outputs import GrammarCompiler, StructuredOutputsParams

    ckpt = open_checkpoint(model_path)
    comp = GrammarCompiler(ckpt.tokenizer(), ckpt.config().vocab_size)
    t0 = time.perf_counter()
    comp.ll_tokenizer
    t1 = time.perf_counter()
    spec = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    comp.compile(spec)
    t2 = time.perf_counter()
    comp.compile(StructuredOutputsParams(json=json.loads(json.dumps(TYPICAL_SCHEMA))))
    t3 = time.perf_counter()
    comp.matcher(spec)
    t4 = time.perf_counter()
    return {"tokenizer_init_s": t1 - t0, "cold_compile_s": t2 - t1, "cached_compile_s": t3 - t2,
            "matcher_copy_s": t4 - t3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="an existing server (default: start one)")
    ap.add_argument("--server-flags", default="--dtype float32",
                    help="flags of the server this starts")
    ap.add_argument("--model", default=None, help="model file for the compile timing and the "
                    "started server (default: the embedded one)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()

    times = compile_times(args.model)
    print("compile of a typical schema: " + ", ".join(
        f"{k.removesuffix('_s')} {v * 1e3:.1f} ms" for k, v in times.items()), flush=True)

    flags = shlex.split(args.server_flags) + (["--model", args.model] if args.model else [])
    server = None if args.base_url else Server(*flags, "--max-num-seqs",
                                               str(max(16, args.concurrency)))
    url = args.base_url or server.__enter__().url
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for c in (True, False):  # warm-up: the first grammar, the batch's first steps
            asyncio.run(phase(url, model, args.concurrency, 8, c))
        rows = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            tpot = {c: statistics.mean(asyncio.run(phase(url, model, args.concurrency,
                                                         args.output_len, c)))
                    for c in order}
            ratio = tpot[True] / tpot[False]
            rows.append({"round": r, "json_schema_tpot_ms": tpot[True] * 1e3,
                         "unconstrained_tpot_ms": tpot[False] * 1e3, "ratio": ratio})
            print(f"round {r}: json_schema TPOT {tpot[True] * 1e3:.1f} ms, unconstrained "
                  f"{tpot[False] * 1e3:.1f} ms, ratio {ratio:.3f}", flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    ratios = [row["ratio"] for row in rows]
    print(f"{args.concurrency} streams x {args.output_len} tokens, median ratio "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"compile": times, "rounds": rows}, f, indent=2)


if __name__ == "__main__":
    main()
