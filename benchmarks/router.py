"""Data parallelism behind the router, side by side in one run: multi-turn chat (each turn's
prompt the conversation so far), all conversations at once, against

    dp-cache     `servelm serve --data-parallel-size N` (cache-aware routing)
    dp-rr        the same with --router-policy round_robin (the baseline router)
    single       one engine on the same cores, the replicas' KV memory together

and prints for each the prefix-cache hit rate over the run (from the engines' /v1/stats),
TTFT p50/p99 and output tokens/s.

    python benchmarks/router.py                            # 16 conversations x 6 turns, DP=2
    python benchmarks/router.py --conversations 2 --turns 2 --max-tokens 4   # a quick check

Every conversation opens with a document of its own (so only its own turns can reuse its
prefix), then asks short questions about it; answers are greedy, --max-tokens long
(ignore_eos). Each server starts on a free loopback port (its command line printed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import httpx

from servelm.bench.process import free_port

PY = sys.executable
WORDS = ("the river city museum bridge winter market harbour garden tower music old new "
         "north south quiet busy early late stone glass painter baker train station square "
         "festival library school castle island mountain lake forest road street window "
         "summer autumn spring night morning light shadow story letter voice friend").split()


class Server:
    """A `servelm serve` process (its data-parallel front, with --data-parallel-size)."""

    def __init__(self, name: str, flags: list[str]):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"servelm-{name}-", suffix=".log")
        cmd = [PY, "-m", "servelm.cli", "serve", "--port", str(self.port), *flags]
        print("$", "servelm", " ".join(cmd[3:]), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-3000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=1)
                if r.status_code == 200 and r.json().get("backends_up", 1) == r.json().get(
                        "backends", 1):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become healthy")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def prefix_cache(url: str) -> tuple[int, int]:
    """(queried, hit) prompt tokens of the server's prefix cache (every replica's, summed)."""
    pc = httpx.get(f"{url}/v1/stats", timeout=30).json()["prefix_cache"]
    return pc["queried_tokens"] or 0, pc["hit_tokens"] or 0


def conversations(n: int, turns: int, doc_words: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for c in range(n):
        doc = " ".join(rng.choices(WORDS, k=doc_words))
        first = f"Here is document {c}: {doc}\n\nWhat is it about?"
        qs = [f"Question {t}: what does it say about the {rng.choice(WORDS)} and the "
              f"{rng.choice(WORDS)}?" for t in range(1, turns)]
        out.append([first, *qs])
    return out


async def run_conversation(client: httpx.AsyncClient, url: str, model: str, turns: list[str],
                           max_tokens: int, ttfts: list[float], counts: list[int]) -> None:
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for question in turns:
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start, first, text, tokens = time.perf_counter(), None, [], 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                for ch in chunk.get("choices", ()):
                    delta = ch.get("delta", {}).get("content")
                    if delta:
                        if first is None:
                            first = time.perf_counter()
                        text.append(delta)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        ttfts.append((first or time.perf_counter()) - start)
        counts.append(tokens)
        messages.append({"role": "assistant", "content": "".join(text)})


async def run_load(url: str, model: str, convs: list[list[str]], max_tokens: int) -> dict:
    ttfts: list[float] = []
    counts: list[int] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(run_conversation(client, url, model, turns, max_tokens,
                                                ttfts, counts) for turns in convs))
        wall = time.perf_counter() - start
    return {"ttft": sorted(ttfts), "output_tokens": sum(counts), "wall_s": wall}


def pct(values: list[float], p: float) -> float:
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)] if values else float("nan")


def measure(name: str, flags: list[str], args, convs) -> dict:
    with Server(name, flags) as srv:
        model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        q0, h0 = prefix_cache(srv.url)
        load = asyncio.run(run_load(srv.url, model, convs, args.max_tokens))
        q1, h1 = prefix_cache(srv.url)
        routed = None
        stats = httpx.get(f"{srv.url}/v1/stats", timeout=30).json()
        if "router" in stats:
            routed = stats["router"]["routed"]
    return {"name": name, "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan"),
            "ttft_p50_ms": pct(load["ttft"], 50) * 1e3, "ttft_p99_ms": pct(load["ttft"], 99) * 1e3,
            "output_tok_s": load["output_tokens"] / load["wall_s"], "requests": len(load["ttft"]),
            "routed": routed}


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(MiB|GiB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"a size like 512MiB, got {text!r}")
    return int(m.group(1)) << {"MiB": 20, "GiB": 30, None: 0}[m.group(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's length")
    p.add_argument("--doc-words", type=int, default=200,
                   help="words of each conversation's opening document")
    p.add_argument("--dp", type=int, default=2, help="replicas")
    p.add_argument("--kv-cache-memory", type=_size, default=256 << 20, metavar="BYTES",
                   help="each replica's KV pool (the single engine gets all of theirs)")
    p.add_argument("--only", default="dp-cache,dp-rr,single",
                   help="which of dp-cache, dp-rr, single to run (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("server_flags", nargs=argparse.REMAINDER,
                   help="after --: flags for every server (model, dtype, ...)")
    args = p.parse_args()
    extra = [f for f in args.server_flags if f != "--"]
    convs = conversations(args.conversations, args.turns, args.doc_words, args.seed)
    kv = args.kv_cache_memory
    configs = {
        "dp-cache": ["--data-parallel-size", str(args.dp), "--router-policy", "cache_aware",
                     "--kv-cache-memory", str(kv)],
        "dp-rr": ["--data-parallel-size", str(args.dp), "--router-policy", "round_robin",
                  "--kv-cache-memory", str(kv)],
        "single": ["--kv-cache-memory", str(kv * args.dp)],
    }
    results = []
    for name in args.only.split(","):
        results.append(measure(name, configs[name] + extra, args, convs))
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.max_tokens} "
          f"tokens an answer, {os.cpu_count()} CPUs")
    print(f"{'':<10} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'out tok/s':>10}  routed")
    for r in results:
        print(f"{r['name']:<10} {r['hit_rate']:>9.1%} {r['ttft_p50_ms']:>8.0f}ms "
              f"{r['ttft_p99_ms']:>8.0f}ms {r['output_tok_s']:>10.1f}  {r['routed'] or ''}")
    single = next((r for r in results if r["name"] == "single"), None)
    if single and single["hit_rate"] > 0:
        for r in results:
            if r is not single:
                print(f"{r['name']}: {r['hit_rate'] / single['hit_rate']:.0%} of the single "
                      f"engine's hit rate")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
