"""A soak of an OpenAI-compatible server: many clients behaving well and badly at once.

Each client walks the kinds in turn, from its own starting point (so every kind runs from
the first round on, different kinds at once): a streamed completion read to the end, a
whole chat answer, a stream dropped after a few events, a non-streaming request given up
on, a slow reader, a malformed body, a body over the server's limit. Meanwhile /health is polled; at
the end the server must have settled: nothing running or waiting, no KV block held.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

JSON = {"Content-Type": "application/json"}
KINDS = ("stream", "chat", "disconnect", "give_up", "slow_reader", "malformed", "oversized")


@dataclass
class SoakReport:
    """What a soak saw. `problems` lists every answer that was not the expected one."""

    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    health_checks: int = 0
    health_max_s: float = 0.0
    health_p99_s: float = 0.0
    settled: dict[str, float] = field(default_factory=dict)  # /metrics once idle again

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def soak(base_url: str, seconds: float, model: str, headers: dict[str, str] | None = None,
               clients: int = 8, max_request_bytes: int | None = None, seed: int = 0,
               max_tokens: int = 24) -> SoakReport:
    """Run the soak for `seconds`; then wait (up to 30 s) for the server to settle."""
    import httpx

    rng = random.Random(seed)
    rep = SoakReport(counts={k: 0 for k in KINDS})
    headers = dict(headers or {})
    completions, chat = f"{base_url}/v1/completions", f"{base_url}/v1/chat/completions"
    kinds = [k for k in KINDS if k != "oversized" or max_request_bytes]
    health: list[float] = []

    def body(i: int, stream: bool) -> dict:
        return {"model": model, "prompt": f"Soak request {i}: tell a story about", "stream": stream,
                "max_tokens": rng.randint(1, max_tokens), "ignore_eos": True,
                "temperature": rng.choice([0.0, 0.8])}

    async def expect(kind: str, resp, status: int) -> None:
        if resp.status_code != status:
            text = (await resp.aread())[:200]
            rep.problems.append(f"{kind}: HTTP {resp.status_code} (wanted {status}): {text!r}")

    async def one(http, i: int, kind: str) -> None:
        rep.counts[kind] += 1
        if kind in ("stream", "slow_reader", "disconnect"):
            keep = rng.randint(1, 4) if kind == "disconnect" else None
            async with http.stream("POST", completions, json=body(i, True)) as resp:
                if resp.status_code != 200:
                    return await expect(kind, resp, 200)
                events = []
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if keep is not None and len(events) >= keep:
                        return  # leaving the block drops the connection mid-stream
                    if kind == "slow_reader":
                        await asyncio.sleep(0.05)
                if events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
                    rep.problems.append(f"{kind}: stream ended badly: {events[-2:]}")
        elif kind == "chat":
            r = await http.post(chat, json={
                "model": model, "max_tokens": rng.randint(1, max_tokens),
                "messages": [{"role": "user", "content": f"Hi {i}"}]})
            await expect(kind, r, 200)
        elif kind == "give_up":
            try:
                await http.post(completions, json={**body(i, False), "max_tokens": 200},
                                timeout=rng.uniform(0.05, 0.4))
            except httpx.TimeoutException:
                pass
        elif kind == "malformed":
            m = model.encode()
            bad = rng.choice([b'{"model": ', b"[1, 2]", b'{"model": "%s", "prompt": 5}' % m,
                              b'{"model": "%s", "prompt": "x", "n": "two"}' % m])
            r = await http.post(completions, content=bad, headers=JSON)
            await expect(kind, r, 400)
        elif kind == "oversized":
            big = json.dumps({"model": model, "prompt": "x" * (max_request_bytes + 1)}).encode()
            r = await http.post(completions, content=big, headers=JSON)
            await expect(kind, r, 413)

    async def client(http, c: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            try:
                await one(http, c * 1_000_000 + i, kinds[(c + i) % len(kinds)])
            except httpx.HTTPError as e:
                rep.problems.append(f"client {c}: {type(e).__name__}: {e}")
            i += 1

    def poll_health() -> None:
        """On its own thread and connection: the clients' own work on this event loop
        must not show up as server latency."""
        with httpx.Client(timeout=5) as http:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                try:
                    r = http.get(f"{base_url}/health")
                    if r.status_code != 200:
                        rep.problems.append(f"/health: HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    rep.problems.append(f"/health: {type(e).__name__}")
                health.append(time.perf_counter() - t)
                time.sleep(0.05)

    # Clients are made first: each one loads TLS settings, ~50 ms of this loop's time.
    https = [httpx.AsyncClient(headers=headers, timeout=60) for _ in range(clients)]
    start = time.monotonic()
    deadline = start + seconds
    poller = threading.Thread(target=poll_health, name="soak-health")
    poller.start()
    try:
        await asyncio.gather(*(client(http, c) for c, http in enumerate(https)))
    finally:
        poller.join()
        for http in https:
            await http.aclose()
    rep.seconds = time.monotonic() - start
    if health:
        health.sort()
        rep.health_checks = len(health)
        rep.health_max_s = health[-1]
        rep.health_p99_s = health[min(len(health) - 1, int(len(health) * 0.99))]
    rep.settled = await _settle(base_url, headers)
    return rep


async def _settle(base_url: str, headers: dict[str, str] | None = None,
                  timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no KV block is held (or at the timeout)."""
    import httpx

    keys = ("servelm_num_requests_running", "servelm_num_requests_waiting",
            "servelm_kv_cache_usage_ratio")
    end = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5, headers=headers) as http:
        while True:
            m = _scrape((await http.get(f"{base_url}/metrics")).text)
            settled = {k: m.get(k, float("nan")) for k in keys}
            if all(v == 0 for v in settled.values()) or time.monotonic() > end:
                return settled
            await asyncio.sleep(0.1)


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
