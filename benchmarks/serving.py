"""Serving benchmarks: `servelm bench` against `servelm serve` processes, side by side in one run.

    python benchmarks/serving.py serve      # 64 concurrent and 1 concurrent, 128 in / 128 out
    python benchmarks/serving.py prefix     # TTFT with a cached 1,000-token prefix vs caching off
    python benchmarks/serving.py capacity   # KV pool for ~20 sequences vs unconstrained, 64 clients
    python benchmarks/serving.py sweep --plot sweep.png   # concurrency 1..64, with the roofline
    python benchmarks/serving.py kv-dtype   # int8 KV vs the model dtype in the same pool bytes

Each scenario starts its servers on free loopback ports, runs the bench command line
(printed, so it can be rerun by hand), and prints the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx

from servelm.bench.process import free_port, run_bench
from servelm.cli import positive

PY = sys.executable


class Server:
    """A `servelm serve` process on a free port; stopped with SIGTERM on exit."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [PY, "-m", "servelm.cli", "serve", "--port", str(self.port), *flags]
        print("$", " ".join(self.cmd[2:]), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def __enter__(self) -> "Server":
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def bench(url: str, *flags: str) -> dict:
    """Run `servelm bench` (its command line printed) and return its JSON summary."""
    return run_bench(url, *flags, echo=True)


def line(name: str, s: dict) -> str:
    return (f"{name:<28} ok {s['completed']:>4} fail {s['failed']:>3}  "
            f"out {s['output_throughput']:8.1f} tok/s  "
            f"TTFT p50 {s['ttft_ms']['p50']:8.1f} p99 {s['ttft_ms']['p99']:8.1f} ms  "
            f"TPOT p50 {s['tpot_ms']['p50']:6.1f} p99 {s['tpot_ms']['p99']:6.1f} ms  "
            f"ITL p99 {s['itl_ms']['p99']:6.1f} ms")


def scenario_serve(args) -> None:
    with Server(*args.server_flags) as srv:
        c64 = bench(srv.url, "--concurrency", "64", "--num-prompts", str(args.num_prompts),
                    "--input-len", "128", "--output-len", "128")
        c1 = bench(srv.url, "--concurrency", "1", "--num-prompts", "8",
                   "--input-len", "128", "--output-len", "128")
    print(line("concurrency 64", c64))
    print(line("concurrency 1", c1))
    print(f"throughput ratio 64 vs 1: {c64['output_throughput'] / c1['output_throughput']:.2f}x")


def scenario_prefix(args) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 20000) for _ in range(1000)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for _ in range(args.prefix_requests):
            suffix = [rng.randrange(1000, 20000) for _ in range(24)]
            f.write(json.dumps({"prompt": prefix + suffix, "output_len": 16}) + "\n")
        data = f.name
    flags = ["--concurrency", "1", "--dataset", data]
    results = {}
    for name, extra in (("prefix caching on", []), ("prefix caching off", ["--no-prefix-caching"])):
        with Server(*args.server_flags, *extra) as srv:
            results[name] = bench(srv.url, *flags)
    os.unlink(data)
    for name, s in results.items():
        print(line(name, s))
    on, off = results["prefix caching on"], results["prefix caching off"]
    print(f"TTFT p50 off / on: {off['ttft_ms']['p50'] / on['ttft_ms']['p50']:.1f}x lower with "
          f"the cached 1,000-token prefix (the first request of the run fills the cache)")


def scenario_capacity(args) -> None:
    # ~20 full sequences of 128 + 128 tokens: 20 * 16 blocks of 16 tokens.
    seq_blocks, block_bytes = 16, 16 * 30 * 2 * 3 * 64 * 2  # bf16 KV of SmolLM2-135M
    small = str(20 * seq_blocks * block_bytes)
    flags = ["--concurrency", "64", "--num-prompts", str(args.num_prompts),
             "--input-len", "128", "--output-len", "128"]
    results = {}
    for name, extra in (("unconstrained pool", []),
                        ("pool for ~20 sequences", ["--kv-cache-memory", small]),
                        ("~20, no admission lookahead", ["--kv-cache-memory", small,
                                                         "--admission-lookahead", "0"])):
        with Server(*args.server_flags, *extra) as srv:
            results[name] = bench(srv.url, *flags)
            metrics = httpx.get(f"{srv.url}/metrics").text
        pre = [ln for ln in metrics.splitlines() if ln.startswith("servelm_num_preemptions_total")]
        results[name]["preemptions"] = float(pre[0].split()[-1]) if pre else 0.0
    for name, s in results.items():
        print(line(name, s) + f"  preemptions {s['preemptions']:.0f}")
    a, b = results["unconstrained pool"], results["pool for ~20 sequences"]
    c = results["~20, no admission lookahead"]
    print(f"throughput constrained / unconstrained: "
          f"{b['output_throughput'] / a['output_throughput']:.2f} "
          f"(without the admission lookahead: {c['output_throughput'] / a['output_throughput']:.2f})")


class MaxRunning:
    """Polls a server's servelm_num_requests_running gauge in a thread: the most sequences
    seen running at once."""

    def __init__(self, url: str, period: float = 0.2):
        import threading

        self.url, self.period, self.max = url, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                for ln in httpx.get(f"{self.url}/metrics", timeout=2).text.splitlines():
                    if ln.startswith("servelm_num_requests_running"):
                        self.max = max(self.max, int(float(ln.split()[-1])))
            except httpx.HTTPError:
                pass
            self._stop.wait(self.period)

    def __enter__(self) -> "MaxRunning":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def scenario_kv_dtype(args) -> None:
    """--kv-cache-dtype int8 against the model dtype, 64 clients, pools of the capacity
    scenario's bytes (~20 bf16 sequences of 128 + 128 tokens). On a CPU that runs fp32 the
    bf16 baseline is an fp32 pool of twice the bytes (the same ~20 sequences); the fp32
    pool of the same bytes is shown too. Servers run one after another, twice over
    (A B C A B C), and the ratios are taken within each round."""
    seq_blocks, block_bytes = 16, 16 * 30 * 2 * 3 * 64 * 2  # bf16 KV of SmolLM2-135M
    small = 20 * seq_blocks * block_bytes
    flags = ["--concurrency", "64", "--num-prompts", str(args.num_prompts),
             "--input-len", "128", "--output-len", "128"]
    cases = (("bf16-sized (fp32, 2x bytes)", ["--kv-cache-memory", str(2 * small)]),
             ("int8, same bytes", ["--kv-cache-memory", str(small), "--kv-cache-dtype", "int8"]),
             ("fp32, same bytes", ["--kv-cache-memory", str(small)]))
    for rnd in range(args.rounds):
        results = {}
        for name, extra in cases:
            with Server(*args.server_flags, *extra) as srv:
                with MaxRunning(srv.url) as mr:
                    results[name] = bench(srv.url, *flags)
                results[name]["max_running"] = mr.max
        print(f"round {rnd + 1}")
        for name, s in results.items():
            print(line(name, s) + f"  max running {s['max_running']}")
        base = results[cases[0][0]]
        for name, s in list(results.items())[1:]:
            print(f"  {name} / {cases[0][0]}: max running "
                  f"{s['max_running'] / max(base['max_running'], 1):.2f}x, throughput "
                  f"{s['output_throughput'] / base['output_throughput']:.2f}x")


def scenario_sweep(args) -> None:
    """servelm bench --sweep-concurrency against one server, with the picture."""
    if args.bandwidth is None or args.flops is None:
        # The roofline at this machine's speed now (measured before the server starts), not
        # a nominal one: a roofline below the measured curve says nothing.
        from servelm.roofline import measure_hardware

        hw = measure_hardware()
        args.bandwidth = args.bandwidth or hw.bandwidth / 1e9
        args.flops = args.flops or hw.flops / 1e12
        print(f"roofline: {args.bandwidth:.1f} GB/s, {args.flops:.2f} TFLOP/s bf16 (measured)",
              flush=True)
    with Server(*args.server_flags, "--roofline-bandwidth", str(args.bandwidth),
                "--roofline-flops", str(args.flops)) as srv:
        cmd = [PY, "-m", "servelm.cli", "bench", "--base-url", srv.url, "--no-progress",
               "--sweep-concurrency", args.levels, "--num-prompts", str(args.sweep_prompts),
               "--input-len", "128", "--output-len", str(args.sweep_output_len),
               "--plot", args.plot, "--json", args.plot.rsplit(".", 1)[0] + ".json"]
        print("$", "servelm", " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("scenario", choices=["serve", "prefix", "capacity", "sweep", "kv-dtype"])
    ap.add_argument("--rounds", type=int, default=2, help="kv-dtype: rounds of the servers")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64", help="sweep: concurrencies")
    ap.add_argument("--sweep-prompts", type=int, default=16,
                    help="sweep: requests per level (at least the level's concurrency)")
    ap.add_argument("--sweep-output-len", type=int, default=64)
    ap.add_argument("--plot", default="sweep.png", help="sweep: the picture (and .json beside)")
    ap.add_argument("--bandwidth", type=positive(float), default=None,
                    help="sweep: the machine's GB/s for the roofline (default: measured)")
    ap.add_argument("--flops", type=positive(float), default=None,
                    help="sweep: bf16 matmul TFLOP/s for the roofline (default: measured)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--prefix-requests", type=int, default=8)
    ap.add_argument("--server-flags", default="", help="extra flags for servelm serve")
    args = ap.parse_args()
    args.server_flags = args.server_flags.split()
    {"serve": scenario_serve, "prefix": scenario_prefix, "capacity": scenario_capacity,
     "kv-dtype": scenario_kv_dtype,
     "sweep": scenario_sweep}[args.scenario](args)


if __name__ == "__main__":
    main()
