"""A kernel table tuned while other jobs load the machine, against one tuned on a quiet
machine: the throughput each start then serves, alternating in one run.

    python benchmarks/noisy_tuning.py [--quantization int4] [--dtype bfloat16] [--jobs 2]
                                      [--streams 64] [--rounds 2]

1. quiet: a fresh engine tunes its linear methods (`kernel_tuning="fresh"`) into a cache
   directory of its own, nothing else running.
2. loaded: `--jobs` PyTorch processes (one thread each, square matmuls in a loop: "other
   jobs" as a shared machine has them) start, a fresh engine tunes into a second directory,
   the jobs stop. The report says whether that table was trusted (cached) or provisional
   (served, not cached: the tuner saw its rounds disagree).
3. Rounds, the two sides taking turns (which goes first alternates): an engine starts with
   `kernel_tuning="cached"` from each directory (a provisional table was not cached, so that
   start measures again, quietly, as a server's would) and generates 128 tokens for each of
   2 x `--streams` prompts of 128 tokens (max_num_seqs `--streams`, greedy, EOS ignored),
   twice after a warm-up; the side's figure is its faster run's output tokens per second
   (startup_ab.py's child, the same workload).

After the tunings it lists where the two tables' fastest methods differ (shape, row bucket,
each table's fastest and its time); `--keep DIR` keeps both tables there.

The target: a table tuned under load serves within 1.1x of a quiet one's speed.
"""

from __future__ import annotations

import argparse
import json
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_ab import CHILD  # noqa: E402  (one engine start, its figures as JSON)

LOAD = """
import torch
torch.set_num_threads(1)
a = torch.randn(768, 768)
while True:
    a = torch.tanh(a @ a)
"""

def child(kernel_tuning: str, cache: str, args, streams: int) -> dict:
    """One engine start (startup_ab.py's child: the same workload and figures) with its
    table in `cache`."""
    r = subprocess.run([sys.executable, "-c", CHILD, "", args.quantization, kernel_tuning,
                        str(streams), cache, "", args.dtype, "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(f"an engine failed to start ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def differences(quiet: str, loaded: str) -> tuple[int, list[str]]:
    """How many (shape, row bucket) pairs both cache directories' tables hold (0 where one
    was not cached), and where they disagree on the fastest method (the tuner's choice adds
    its margins and the DecodeStack's saving on top)."""
    def table(d: str) -> dict:
        files = glob.glob(os.path.join(d, "**", "linear-methods-*.json"), recursive=True)
        return json.loads(Path(files[0]).read_text())["shapes"] if files else {}

    def fastest(entry: dict, b: int) -> tuple[str, float]:
        times = {m: ts[b] for m, ts in entry["times_us"].items() if b < len(ts) and ts[b] is not None}
        m = min(times, key=times.get) if times else "-"
        return m, times.get(m, float("nan"))
    q, n = table(quiet), table(loaded)
    common = sorted(k for k in set(q) & set(n) if "times_us" in q[k] and "attention" not in k)
    out = []
    for shape in common:
        for b, rows in enumerate((1, 8, 64, 512)):
            (mq, tq), (mn, tn) = fastest(q[shape], b), fastest(n[shape], b)
            if mq != mn:
                out.append(f"  {shape} at {rows} rows: quiet {mq} {tq:.0f} us, loaded {mn} {tn:.0f} us"
                           f" (the loaded table times {mq} at "
                           f"{(n[shape]['times_us'].get(mq) or [None] * 4)[b] or float('nan'):.0f} us)")
    return len(common) * 4, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="at least 1")
    ap.add_argument("--keep", default=None, help="a directory to keep both tables in")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="servelm-noisy-") as tmp:
        dirs = {"quiet": os.path.join(tmp, "quiet"), "loaded": os.path.join(tmp, "loaded")}
        tuned = {"quiet": child("fresh", dirs["quiet"], args, 0)}
        jobs = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(args.jobs)]
        try:
            time.sleep(1.0)
            tuned["loaded"] = child("fresh", dirs["loaded"], args, 0)
        finally:
            for j in jobs:
                j.kill()
                j.wait()
        for side, r in tuned.items():
            print(f"{side} tuning: {r['start']:.1f} s to start, table "
                  f"{'provisional (not cached)' if r['provisional'] else 'trusted (cached)'}")
        pairs, diff = differences(dirs["quiet"], dirs["loaded"])
        print(f"the tables' fastest methods differ at {len(diff)} of {pairs} (shape, bucket) pairs"
              + (" (a table was not cached)" if not pairs else "")
              + (":\n" + "\n".join(diff) if diff else ""))
        if args.keep:
            for side, d in dirs.items():
                if os.path.isdir(d):
                    shutil.copytree(d, os.path.join(args.keep, side), dirs_exist_ok=True)
        rates: dict[str, list[float]] = {"quiet": [], "loaded": []}
        for rnd in range(args.rounds):
            order = ["quiet", "loaded"] if rnd % 2 == 0 else ["loaded", "quiet"]
            for side in order:
                r = child("cached", dirs[side], args, args.streams)
                rates[side].append(r["tok_s"])
                print(f"round {rnd + 1} {side}: {r['tok_s']:.1f} tok/s (start {r['start']:.1f} s"
                      f"{', measured again' if r['source'] == 'measured' else ''})")
        ratios = [q / n for q, n in zip(rates["quiet"], rates["loaded"])]
        print(f"{args.streams} streams: quiet {statistics.median(rates['quiet']):.1f} tok/s, "
              f"loaded {statistics.median(rates['loaded']):.1f} tok/s; quiet / loaded per round "
              + ", ".join(f"{x:.2f}x" for x in ratios)
              + f", median {statistics.median(ratios):.2f}x (bar: <= 1.10x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
