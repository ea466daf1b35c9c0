"""Engine start-up (or --streams: throughput) of this work tree against another revision,
alternating in one run.

    python benchmarks/startup_ab.py --base REV [--model PATH] [--quantization int4|int8|none]
                                    [--dtype bfloat16|float32|auto]
                                    [--kernel-tuning cached|fresh] [--rounds N]
                                    [--base-kernels DIR] [--base-tree DIR] [--streams N]
                                    [--ttft N[,N...]]
                                    [--without-amx]

Each side builds `LLM(model, dtype, quantization, kernel_tuning)` (dtype bfloat16 unless
--dtype says otherwise; auto: the engine's default for this CPU and format) in a fresh
process, the two sides taking turns (which goes first alternates by round), and reports the
seconds the engine took to start (loading, quantising, tuning or reading the table back,
building the layers) and the tuner's own seconds. With --streams N the same engine
(max_num_seqs N) then generates 128 tokens for each of 2N prompts of 128 tokens (greedy,
ignoring EOS) twice, after a short warm-up, and the side's figure is the faster run's
output tokens per second (prefill included, as a batch of requests arriving at once);
--streams 1 also times the decode step alone (the median of a request's engine steps after
its prompt's, the best of three requests).
With --ttft N the engine (prefix caching off) also times one prompt of N tokens, one
token out, three times after an untimed one, and the side's figure is the fastest.
REV is checked out into a temporary git worktree, its C++ kernels built into their own
directory first (a few minutes, not timed; --base-kernels keeps them for the next run).
Each side keeps its kernel table in a directory of its own; with --kernel-tuning cached,
its first start measures the table and is not counted. A revision from before the tuner
(no `kernel_tuning` argument) runs its built-in choices.

--without-amx runs both sides as on a CPU without AMX, to check on an AMX machine that the
paths a CPU without it takes (AVX512-BF16, as on the AMD EPYC) did not get slower: oneDNN
capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA) and servelm's own AMX kernels reported
unavailable, so the tuner and the attention selection never see them. (Only the code paths
are the other machine's: its cache sizes and bandwidth are not.)
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
import inspect, json, statistics, sys, time
t = time.perf_counter()
from servelm import LLM, SamplingParams
if sys.argv[8] == "1":  # --without-amx: servelm's AMX kernels (where this revision has them)
    try:
        import servelm.layers.amx as amx
        amx.available = lambda: False
    except ImportError:
        pass
    try:
        import servelm.attention.cpu as attention_cpu
        attention_cpu.amx_available = lambda: False
    except ImportError:
        pass
q = None if sys.argv[2] == "none" else sys.argv[2]
kw = {"model": sys.argv[1]} if sys.argv[1] else {}
streams = int(sys.argv[4])
ttfts = [int(n) for n in sys.argv[6].split(",") if n]
if streams:
    kw["max_num_seqs"] = streams
if ttfts:
    kw.update(enable_prefix_caching=False, max_model_len=max(ttfts) + 64)
if "kernel_tuning" in inspect.signature(LLM).parameters:  # else: from before the tuner
    kw.update(kernel_tuning=sys.argv[3], tuning_cache_dir=sys.argv[5])
llm = LLM(dtype=sys.argv[7], quantization=q, **kw)
executor = getattr(llm.engine, "executor", None)  # the model's side, where it has one
tuning = getattr(executor or llm.engine, "tuning", None)
out = {"start": time.perf_counter() - t, "tuning": tuning.seconds if tuning else 0.0,
       "source": tuning.source if tuning else "none",
       "provisional": bool(getattr(tuning, "provisional", False))}
vocab = llm.get_tokenizer().vocab_size
if streams:
    ids = [[(1000 + 7 * i + j) % vocab for j in range(128)] for i in range(2 * streams)]
    llm.generate(ids[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(ids, sp, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, n / (time.perf_counter() - t))
    out["tok_s"] = best
    if streams == 1:  # the decode step alone: the median over a request's steps, best of 3
        eng, per_request = llm.engine, []
        for r in range(3):
            prompt = [(3000 + 13 * r + j) % vocab for j in range(128)]
            eng.add_request(f"steps-{r}", None, sp, prompt_token_ids=prompt)
            times, done = [], False
            while not done:
                t = time.perf_counter()
                outs = eng.step()
                times.append(time.perf_counter() - t)
                done = any(o.finished for o in outs)
            per_request.append(statistics.median(times[2:]))  # after the prompt's step
        out["step_ms"] = min(per_request) * 1000
for n in ttfts:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(4):
        ids = [(2000 + 11 * i + j) % vocab for j in range(n)]
        t = time.perf_counter()
        llm.generate([ids], one, use_tqdm=False)
        times.append(time.perf_counter() - t)
    out[f"ttft_{n}"] = min(times[1:])
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--model", default="", help="a GGUF file or HF directory (default: the "
                    "embedded model)")
    ap.add_argument("--quantization", default="none", choices=("none", "int4", "int8"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"),
                    help="the activations' dtype on both sides")
    ap.add_argument("--kernel-tuning", default="cached", choices=("cached", "fresh"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base-kernels", default=None,
                    help="where REV's kernels are built (default: a temporary directory)")
    ap.add_argument("--base-tree", default=None, metavar="DIR",
                    help="an existing checkout of REV to run (kept; with --base-kernels its "
                         "kernels are built once for all runs) instead of a temporary worktree")
    ap.add_argument("--streams", type=int, default=0,
                    help="also time generation with this many streams (e.g. 64)")
    ap.add_argument("--ttft", default="", metavar="N[,N...]",
                    help="also time the first token of a prompt of each of these lengths")
    ap.add_argument("--without-amx", action="store_true",
                    help="both sides as on a CPU without AMX (oneDNN capped at "
                         "AVX512_CORE_BF16, servelm's AMX kernels hidden)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.streams < 0:
        ap.error(f"--streams must be at least 1 (0: start-up only), got {args.streams}")
    try:
        ttfts = [int(n) for n in args.ttft.split(",") if n.strip()]
    except ValueError:
        ttfts = [0]
    if any(n < 1 for n in ttfts):
        ap.error(f"--ttft must be prompt lengths of at least 1 token, got {args.ttft!r}")
    if args.model and not os.path.exists(args.model):
        ap.error(f"--model {args.model}: no such file or directory")
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True)
    if rev.returncode:
        ap.error(f"--base {args.base}: not a revision of this repository")
    with tempfile.TemporaryDirectory(prefix="servelm-startup-ab-") as tmp:
        base = Path(args.base_tree) if args.base_tree else Path(tmp) / "base"
        if not args.base_tree:
            subprocess.run(["git", "worktree", "add", "--detach", str(base), rev.stdout.strip()],
                           cwd=ROOT, check=True, capture_output=True)
        try:
            kernels = args.base_kernels or str(Path(tmp) / "kernels")
            env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16") \
                if args.without_amx else os.environ
            envs = {"base": dict(env, PYTHONPATH=str(base), SERVELM_KERNEL_DIR=kernels),
                    "tree": dict(env, PYTHONPATH=str(ROOT))}
            print(f"building {args.base}'s kernels ...", flush=True)
            # (Its exit status says whether every kernel built; one that did not leaves
            # that side on its PyTorch fallback, as it would run for a user.)
            subprocess.run([sys.executable, "-m", "servelm.kernels"], env=envs["base"], cwd=tmp,
                           capture_output=True)

            def start(side: str) -> dict:
                r = subprocess.run([sys.executable, "-c", CHILD, args.model, args.quantization,
                                    args.kernel_tuning, str(args.streams),
                                    str(Path(tmp) / f"{side}-cache"),
                                    ",".join(map(str, ttfts)), args.dtype,
                                    "1" if args.without_amx else "0"], env=envs[side],
                                   cwd=tmp, capture_output=True, text=True)
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
                    streams = f", {got['tok_s']:.1f} tok/s" if args.streams else ""
                    streams += (f", decode step {got['step_ms']:.2f} ms"
                                if "step_ms" in got else "")
                    streams += "".join(f", TTFT {n} {got[f'ttft_{n}'] * 1000:.0f} ms"
                                       for n in ttfts)
                    print(f"round {r + 1} {side}: start {got['start']:.2f} s, tuning "
                          f"{got['source']} {got['tuning']:.2f} s{streams}", flush=True)
        finally:
            if not args.base_tree:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                               capture_output=True)
    for key in ("start", "tuning"):
        b = statistics.median(x[key] for x in res["base"])
        t = statistics.median(x[key] for x in res["tree"])
        ratio = f"{b / t:.2f}x" if t > 0 else "-"
        print(f"{key:>6}: {args.base} {b:.2f} s, this tree {t:.2f} s, {args.base} / this tree "
              f"{ratio}")
    if args.streams:  # each round's pair, then their median
        ratios = [t["tok_s"] / b["tok_s"] for b, t in zip(res["base"], res["tree"])]
        b = statistics.median(x["tok_s"] for x in res["base"])
        t = statistics.median(x["tok_s"] for x in res["tree"])
        print(f"{args.streams} streams: {args.base} {b:.1f} tok/s, this tree {t:.1f} tok/s; this "
              f"tree / {args.base} per round " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f", median {statistics.median(ratios):.2f}x")
    if args.streams == 1:  # the decode step alone (base time / tree time)
        ratios = [b["step_ms"] / t["step_ms"] for b, t in zip(res["base"], res["tree"])]
        print(f"decode step: {args.base} {statistics.median(x['step_ms'] for x in res['base']):.2f}"
              f" ms, this tree {statistics.median(x['step_ms'] for x in res['tree']):.2f} ms; "
              f"{args.base} / this tree per round " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f", median {statistics.median(ratios):.2f}x")
    for n in ttfts:  # each round's pair (base time / tree time: over 1, the tree is faster)
        key = f"ttft_{n}"
        ratios = [b[key] / t[key] for b, t in zip(res["base"], res["tree"])]
        b = statistics.median(x[key] for x in res["base"]) * 1000
        t = statistics.median(x[key] for x in res["tree"]) * 1000
        print(f"TTFT {n}: {args.base} {b:.0f} ms, this tree {t:.0f} ms; {args.base} / this "
              f"tree per round " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f", median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
