"""Engine start-up of this work tree against another revision, alternating in one run.

    python benchmarks/startup_ab.py --base REV [--model PATH] [--quantization int4|int8|none]
                                    [--kernel-tuning cached|fresh] [--rounds N]
                                    [--base-kernels DIR]

Each side builds `LLM(model, dtype="bfloat16", quantization, kernel_tuning)` in a fresh
process, the two sides taking turns (which goes first alternates by round), and reports the
seconds the engine took to start (loading, quantising, tuning or reading the table back,
building the layers) and the tuner's own seconds. REV is checked out into a temporary git
worktree, its C++ kernels built into their own directory first (a few minutes, not timed;
--base-kernels keeps them for the next run).
With --kernel-tuning cached, each side's first start measures its table (the kernel
sources are part of the cache key) and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
t = time.perf_counter()
from servelm import LLM
q = None if sys.argv[2] == "none" else sys.argv[2]
kw = {"model": sys.argv[1]} if sys.argv[1] else {}
llm = LLM(dtype="bfloat16", quantization=q, kernel_tuning=sys.argv[3], **kw)
print(json.dumps({"start": time.perf_counter() - t, "tuning": llm.engine.tuning.seconds,
                  "source": llm.engine.tuning.source}))
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--model", default="", help="a GGUF file or HF directory (default: the "
                    "embedded model)")
    ap.add_argument("--quantization", default="none", choices=("none", "int4", "int8"))
    ap.add_argument("--kernel-tuning", default="cached", choices=("cached", "fresh"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base-kernels", default=None,
                    help="where REV's kernels are built (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.model and not os.path.exists(args.model):
        ap.error(f"--model {args.model}: no such file or directory")
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True)
    if rev.returncode:
        ap.error(f"--base {args.base}: not a revision of this repository")
    with tempfile.TemporaryDirectory(prefix="servelm-startup-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev.stdout.strip()],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            kernels = args.base_kernels or str(Path(tmp) / "kernels")
            envs = {"base": dict(os.environ, PYTHONPATH=str(base), SERVELM_KERNEL_DIR=kernels),
                    "tree": dict(os.environ, PYTHONPATH=str(ROOT))}
            print(f"building {args.base}'s kernels ...", flush=True)
            # (Its exit status says whether every kernel built; one that did not leaves
            # that side on its PyTorch fallback, as it would run for a user.)
            subprocess.run([sys.executable, "-m", "servelm.kernels"], env=envs["base"], cwd=tmp,
                           capture_output=True)

            def start(side: str) -> dict:
                r = subprocess.run([sys.executable, "-c", CHILD, args.model, args.quantization,
                                    args.kernel_tuning], env=envs[side], cwd=tmp,
                                   capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"{side} failed to start:\n{r.stderr[-2000:]}")
                return json.loads(r.stdout.strip().splitlines()[-1])

            if args.kernel_tuning == "cached":
                for side in envs:  # each side's table, measured once
                    start(side)
            res: dict[str, list[dict]] = {"base": [], "tree": []}
            for r in range(args.rounds):
                for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                    res[side].append(start(side))
                    got = res[side][-1]
                    print(f"round {r + 1} {side}: start {got['start']:.2f} s, tuning "
                          f"{got['source']} {got['tuning']:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)
    for key in ("start", "tuning"):
        b = statistics.median(x[key] for x in res["base"])
        t = statistics.median(x[key] for x in res["tree"])
        ratio = f"{b / t:.2f}x" if t > 0 else "-"
        print(f"{key:>6}: {args.base} {b:.2f} s, this tree {t:.2f} s, {args.base} / this tree "
              f"{ratio}")


if __name__ == "__main__":
    main()
