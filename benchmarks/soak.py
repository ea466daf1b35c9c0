"""Soak: a server under well- and badly-behaved clients for minutes, then checked for leaks.

    python benchmarks/soak.py [--duration 300] [--clients 16] [--base-url URL --pid PID]
                              [-- servelm serve flags...]

Without --base-url it starts `servelm serve` on the embedded model (fp32, 2 threads, a 1 MiB
body limit; flags after `--` are added). Clients stream, chat, drop streams mid-way, give
up on non-streaming requests, read slowly, and send malformed and oversized bodies (see
servelm/bench/soak.py). Reported: the request mix, every unexpected answer, /health
latency (max and p99) throughout, the server's RSS after a warm-up and at the end, and
whether it settled (nothing running or waiting, no KV block held). Exit status 1 on any
problem, a /health answer slower than --health-limit, or RSS growth over --rss-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from servelm.bench.soak import rss_bytes, soak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"
MAX_BODY = 1 << 20


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, object]:
    log = tempfile.NamedTemporaryFile("w+", prefix="servelm-soak-", suffix=".log")
    cmd = [sys.executable, "-m", "servelm.cli", "serve", "--port", "0", "--dtype", "float32",
           "--num-threads", "2", "--kv-cache-memory", "256MiB",
           "--max-request-bytes", str(MAX_BODY), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while True:
        with open(log.name) as f:
            m = re.search(r"on (http://[\d.]+:\d+)", f.read())
        if m:
            return proc, m.group(1), log
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log.name) as f:
                sys.exit(f"server did not start:\n{f.read()}")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=15.0,
                    help="seconds of the same load before the first RSS reading")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--base-url", default=None, help="soak a running server instead")
    ap.add_argument("--pid", type=int, default=None, help="its pid, for RSS (with --base-url)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="the server's body limit, for the oversized client (default: 1 MiB "
                    "for a server started here, none otherwise)")
    ap.add_argument("--health-limit", type=float, default=0.1, metavar="S")
    ap.add_argument("--rss-limit", type=float, default=64.0, metavar="MiB")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("serve_flags", nargs="*", help="after --: more `servelm serve` flags")
    args = ap.parse_args()
    if args.duration <= 0 or args.warmup < 0 or args.clients < 1:
        ap.error("--duration and --clients must be > 0, --warmup >= 0")
    if args.base_url is None:
        proc, url, _log = start_server(args.serve_flags)  # _log: the file lives until exit
        pid, max_body = proc.pid, args.max_request_bytes or MAX_BODY
    else:
        proc, url, pid, max_body = None, args.base_url.rstrip("/"), args.pid, \
            args.max_request_bytes
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        import httpx
        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.2)
        common = dict(model=args.model, headers=headers, clients=args.clients,
                      max_request_bytes=max_body)
        if args.warmup:
            asyncio.run(soak(url, args.warmup, seed=1, **common))
        rss0 = rss_bytes(pid) if pid else None
        rep = asyncio.run(soak(url, args.duration, seed=2, **common))
        rss1 = rss_bytes(pid) if pid else None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    growth = (rss1 - rss0) / 2**20 if rss0 else None
    print(f"soak: {sum(rep.counts.values())} requests in {rep.seconds:.0f} s from "
          f"{args.clients} clients: " + ", ".join(f"{k} {v}" for k, v in rep.counts.items()))
    print(f"/health: {rep.health_checks} checks, max {rep.health_max_s * 1e3:.1f} ms, "
          f"p99 {rep.health_p99_s * 1e3:.1f} ms")
    if growth is not None:
        print(f"RSS: {rss0 / 2**20:.0f} MiB after warm-up, {rss1 / 2**20:.0f} MiB at the end "
              f"({growth:+.1f} MiB)")
    print(f"settled: {rep.settled}")
    for p in rep.problems[:20]:
        print(f"  problem: {p}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**rep.to_dict(), "rss_before": rss0, "rss_after": rss1}, f, indent=1)
    bad = (rep.problems or rep.health_max_s > args.health_limit
           or any(v != 0 for v in rep.settled.values())
           or (growth is not None and growth > args.rss_limit))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
