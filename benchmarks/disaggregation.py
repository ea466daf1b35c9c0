"""Disaggregated prefill and decode against colocated serving, side by side in one run, on the
same cores, under a mixed load:

    chat       --chatters closed-loop clients, each asking a short question (a few dozen
               tokens) for a long answer (--answer-tokens), streamed, again and again
    documents  long prompts (--doc-words words each, every one its own) for a short answer
               (--doc-answer-tokens), arriving at random (Poisson, --doc-rate a second)

against, one server at a time:

    disagg     `servelm serve --disaggregate 1:1`: a prefill replica and a decode replica,
               one core each, behind the router (long uncached prompts prefilled apart)
    dp         `servelm serve --data-parallel-size 2`: two colocated replicas, cache-aware
    single     one engine on every core
    chunked    the same, with prompts in chunks of --chunk tokens a step (vLLM's way of
               bounding the stall a prompt causes)

and prints for each: TTFT p50/p99 of both kinds, the chat answers' TPOT p50/p99 (mean time
between tokens of one answer) and inter-token gaps (p99, p99.9, the longest: the stalls a
prompt sharing a step causes), and output tokens/s.

    python benchmarks/disaggregation.py                        # 60 s of load each
    python benchmarks/disaggregation.py --seconds 10 --only disagg,single   # a quick check

Flags after `--` go to every server (model, dtype, ...)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router import WORDS, Server, pct  # noqa: E402


def wait_split_ready(url: str, timeout: float = 120) -> None:
    """A disaggregated front splits once it has the tokenizer and the decode receiver."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = httpx.get(f"{url}/v1/stats", timeout=30).json()
        r = s.get("router")
        if r is None or not r.get("prefill_backends_up"):
            return
        if r.get("tokenizer") and all(b.get("kv_receiver") for b in s["backends"]
                                      if b.get("role") == "decode"):
            return
        time.sleep(0.5)
    raise RuntimeError("the router never became ready to split")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
              max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if any(ch.get("text") for ch in chunk.get("choices", ())):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - start if times else float("nan"),
            "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "gaps": gaps, "tokens": len(times)}


async def run_load(url: str, model: str, args) -> dict:
    rng = random.Random(args.seed)
    chat, docs = [], []
    stop_at = time.perf_counter() + args.seconds

    async def chatter(i: int, client):
        k = 0
        while time.perf_counter() < stop_at:
            q = " ".join(rng.choices(WORDS, k=12))
            chat.append(await one(client, url, model, f"Client {i} question {k}: tell me a "
                                  f"long story about {q}.", args.answer_tokens))
            k += 1

    async def documents(client):
        pending, k = [], 0
        while True:
            await asyncio.sleep(rng.expovariate(args.doc_rate))
            if time.perf_counter() >= stop_at:
                break
            doc = " ".join(rng.choices(WORDS, k=args.doc_words))
            pending.append(asyncio.ensure_future(one(
                client, url, model, f"Document {k}: {doc}\n\nSummary:", args.doc_answer_tokens)))
            k += 1
        docs.extend(await asyncio.gather(*pending))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(chatter(i, client) for i in range(args.chatters)),
                             documents(client))
        wall = time.perf_counter() - t0
    return {"chat": chat, "docs": docs, "wall_s": wall}


def summarise(name: str, load: dict) -> dict:
    chat, docs = load["chat"], load["docs"]
    tpots = sorted(c["tpot"] for c in chat if c["tpot"] is not None)
    gaps = sorted(g for c in chat for g in c["gaps"])
    tokens = sum(c["tokens"] for c in chat + docs)
    return {"name": name, "chat_requests": len(chat), "doc_requests": len(docs),
            "doc_ttft_p50_ms": pct(sorted(d["ttft"] for d in docs), 50) * 1e3,
            "doc_ttft_p99_ms": pct(sorted(d["ttft"] for d in docs), 99) * 1e3,
            "chat_ttft_p50_ms": pct(sorted(c["ttft"] for c in chat), 50) * 1e3,
            "chat_ttft_p99_ms": pct(sorted(c["ttft"] for c in chat), 99) * 1e3,
            "tpot_p50_ms": pct(tpots, 50) * 1e3, "tpot_p99_ms": pct(tpots, 99) * 1e3,
            "gap_p99_ms": pct(gaps, 99) * 1e3, "gap_p999_ms": pct(gaps, 99.9) * 1e3,
            "gap_max_ms": (gaps[-1] if gaps else float("nan")) * 1e3,
            "output_tok_s": tokens / load["wall_s"]}


def measure(name: str, flags: list[str], args) -> dict:
    with Server(name, flags) as srv:
        wait_split_ready(srv.url)
        model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        # A warm-up of each kind, so that no side pays its first-touch costs in the run.
        asyncio.run(one(httpx.AsyncClient(timeout=600), srv.url, model,
                        "Warm-up: " + " ".join(WORDS * 3), 4))
        out = summarise(name, asyncio.run(run_load(srv.url, model, args)))
        stats = httpx.get(f"{srv.url}/v1/stats", timeout=30).json()
        out["prefilled"] = (stats.get("router") or {}).get("prefilled")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="load time per server")
    p.add_argument("--chatters", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--doc-words", type=int, default=700, help="about 1.3 tokens a word")
    p.add_argument("--doc-answer-tokens", type=int, default=8)
    p.add_argument("--doc-rate", type=float, default=0.5, help="documents a second")
    p.add_argument("--only", default="disagg,dp,single,chunked")
    p.add_argument("--chunk", type=int, default=512,
                   help="chunked: one engine whose steps take at most this many tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("server_flags", nargs=argparse.REMAINDER,
                   help="after --: flags for every server (model, dtype, ...)")
    args = p.parse_args()
    extra = [f for f in args.server_flags if f != "--"]
    configs = {"disagg": ["--disaggregate", "1:1"], "dp": ["--data-parallel-size", "2"],
               "single": [], "chunked": ["--max-num-batched-tokens", str(args.chunk)]}
    results = [measure(name, configs[name] + extra, args) for name in args.only.split(",")]
    print(f"\n{args.chatters} chat clients ({args.answer_tokens}-token answers) + documents "
          f"of {args.doc_words} words at {args.doc_rate}/s ({args.doc_answer_tokens}-token "
          f"answers), {args.seconds:.0f} s, {os.cpu_count()} CPUs")
    print(f"{'':<8} {'doc TTFT p50/p99':>18} {'chat TTFT p50/p99':>18} {'TPOT p50/p99':>14} "
          f"{'gap p99/p99.9/max':>19} {'out tok/s':>9}  requests (chat, docs)")
    for r in results:
        print(f"{r['name']:<8} {r['doc_ttft_p50_ms']:>8.0f}/{r['doc_ttft_p99_ms']:<7.0f}ms "
              f"{r['chat_ttft_p50_ms']:>8.0f}/{r['chat_ttft_p99_ms']:<7.0f}ms "
              f"{r['tpot_p50_ms']:>5.1f}/{r['tpot_p99_ms']:<5.1f}ms "
              f"{r['gap_p99_ms']:>5.0f}/{r['gap_p999_ms']:.0f}/{r['gap_max_ms']:<6.0f}ms "
              f"{r['output_tok_s']:>9.1f}  {r['chat_requests']}, {r['doc_requests']}"
              + (f"  prefilled {r['prefilled']}" if r["prefilled"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
