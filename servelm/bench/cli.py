"""`servelm bench`: the argument parser and the command that drives a run.

Only argparse is imported at module level: `servelm generate` builds this parser too, and
must not pay for httpx or tqdm.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any


# What a bare `servelm bench` does: a local `servelm serve` (its default address), random
# prompts, a few requests in flight.
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 128
DEFAULT_NUM_PROMPTS = 32
DEFAULT_CONCURRENCY = 8


class BenchError(Exception):
    """A run that cannot start or go on: reported as one line, no traceback."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str, allow_inf: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or (math.isinf(value) and not allow_inf):
        what = "a positive number" + (" or 'inf'" if allow_inf else "")
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _level_list(text: str) -> list[int]:
    levels = [_positive_int(t.strip()) for t in text.split(",") if t.strip()]
    if not levels:
        raise argparse.ArgumentTypeError(f"expected comma-separated concurrencies, got {text!r}")
    return sorted(set(levels))


def _rate(text: str) -> float:
    return _positive_float(text, allow_inf=True)


def _slo(text: str) -> dict[str, float]:
    from servelm.bench.report import parse_slo

    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `bench` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server",
        description="Load generator for any OpenAI-compatible completions endpoint: streams "
                    "requests at a fixed concurrency or Poisson rate and reports TTFT, TPOT, "
                    "inter-token latency, end-to-end latency, throughput and goodput.")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help="server root (default: %(default)s, where `servelm serve` listens)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (token-id prompts, exact input length) or "
                        "/v1/chat/completions (word prompts) (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first one listed at /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=_positive_int, metavar="N",
                      help="keep N requests in flight (default, when neither --request-rate "
                           f"nor --sweep-concurrency is given: {DEFAULT_CONCURRENCY})")
    mode.add_argument("--request-rate", type=_rate, metavar="R",
                      help="Poisson arrivals at R requests/s ('inf': all at once)")
    mode.add_argument("--sweep-concurrency", type=_level_list, metavar="N,N,...",
                      help="one run per concurrency level (e.g. 1,2,4,8,16,32,64), each "
                           "sending max(--num-prompts, level) requests")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the run: TTFT, TPOT and ITL distributions and output tokens/s "
                        "over time; with --sweep-concurrency, tok/s, TTFT and TPOT against "
                        "concurrency, with the server's roofline (servelm servers) as the ideal")
    p.add_argument("--num-prompts", type=_positive_int, metavar="N",
                   help=f"requests to send (default: {DEFAULT_NUM_PROMPTS}; with --dataset: "
                        "one per line)")
    p.add_argument("--input-len", type=_positive_int, metavar="N",
                   help="prompt length in tokens for random prompts "
                        f"(default: {DEFAULT_INPUT_LEN})")
    p.add_argument("--output-len", type=_positive_int, metavar="N",
                   help="max_tokens per request (with --dataset: for lines without output_len) "
                        f"(default for random prompts: {DEFAULT_OUTPUT_LEN})")
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help='prompts, one {"prompt": ..., "output_len": ...} per line '
                        "(default: random prompts)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for prompts and arrival times (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: %(default)s)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject the field)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="ask for whole answers (stream=false), as non-streaming clients do: "
                   "each answer counts as one chunk, so TTFT is the end-to-end latency")
    p.add_argument("--slo", type=_slo, default=None, metavar="SPEC",
                   help="goodput limits in seconds, e.g. ttft=0.5,tpot=0.05 (or 500ms)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write config, aggregates and per-request records as JSON")
    p.add_argument("--timeout", type=_positive_float, default=600.0, metavar="SECONDS",
                   help="per-request read timeout (default: %(default)g)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up request")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (also off when stderr is not a terminal)")
    p.set_defaults(func=run_bench)
    return p


def apply_defaults(args) -> None:
    """Fill in what the parser leaves unset because it depends on other flags: the mode
    (--concurrency when none is given) and, for random prompts, the request count and the
    lengths. A dataset keeps its own count and lengths, as without these defaults."""
    if args.concurrency is None and args.request_rate is None and args.sweep_concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY
    if args.dataset is None:
        for name, value in (("num_prompts", DEFAULT_NUM_PROMPTS),
                            ("input_len", DEFAULT_INPUT_LEN), ("output_len", DEFAULT_OUTPUT_LEN)):
            if getattr(args, name) is None:
                setattr(args, name, value)


def _check_args(args) -> None:
    if not args.base_url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url must start with http:// or https://, got {args.base_url!r}")


def _urls(base_url: str, endpoint: str) -> tuple[str, str]:
    """(request URL, models URL); a base URL ending in /v1 is not doubled up."""
    base = base_url.rstrip("/")
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-3]
    return base + endpoint, base + "/v1/models"


def _prompts(args, kind: str):
    from servelm.bench import datasets

    if args.dataset is not None:
        try:
            return datasets.load_jsonl(args.dataset, args.num_prompts, args.output_len,
                                       allow_token_ids=kind == "completions")
        except datasets.DatasetError as e:
            raise BenchError(str(e)) from None
    # A sweep level sends at least as many requests as its concurrency.
    n = max([args.num_prompts] + (args.sweep_concurrency or []))
    if kind == "completions":
        return datasets.random_token_prompts(n, args.input_len, args.output_len,
                                             seed=args.seed)
    return datasets.random_word_prompts(n, args.input_len, args.output_len,
                                        seed=args.seed)


def _config(args, url: str, model: str | None, kind: str, n: int) -> dict[str, Any]:
    import datetime

    rate = args.request_rate
    return {
        "url": url, "endpoint_kind": kind, "model": model, "num_prompts": n,
        "concurrency": args.concurrency, "sweep_concurrency": args.sweep_concurrency,
        # JSON has no infinity; keep the file readable by strict parsers.
        "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
        "input_len": args.input_len, "output_len": args.output_len, "dataset": args.dataset,
        "seed": args.seed, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "slo": args.slo, "warmup": args.warmup, "stream": args.stream,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


async def _discover(client, models_url: str, headers: dict[str, str], model: str | None) -> str:
    """Fail fast if the server is unreachable; the model to use (given, or the first listed)."""
    import httpx

    try:
        resp = await client.get(models_url, headers=headers, timeout=10.0)
    except httpx.TimeoutException:
        raise BenchError(f"no answer from {models_url} within 10 s") from None
    except httpx.ConnectError as e:
        raise BenchError(f"cannot connect to {models_url} ({e}): is the server running?") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach {models_url}: {e or type(e).__name__}") from None
    if model is not None:
        return model  # any answer at all means the server is there
    try:
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"no model listed at {models_url} (HTTP {resp.status_code}); "
                         f"pass --model") from None


async def _scrape_servelm(client, url: str, headers: dict | None = None
                          ) -> dict[str, float] | None:
    """A servelm server's Prometheus counters ({name: value}); None from other servers.
    headers: the API key, which guards /metrics too unless the server opens it."""
    try:
        r = await client.get(url, timeout=5, headers=headers)
    except Exception:
        return None
    if r.status_code != 200 or "servelm_" not in r.text:
        return None
    out = {}
    for line in r.text.splitlines():
        if line.startswith("servelm_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


async def _bench(args, prompts, kind: str, url: str, models_url: str) -> int:
    import httpx

    from servelm.bench import client as bc
    from servelm.bench import report
    from servelm.bench.datasets import BenchPrompt, random_word_prompts

    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # Enough connections that the pool never queues a request the scheduler released
    # (None: unbounded, for rate mode).
    levels = args.sweep_concurrency or [args.concurrency]
    n = None if levels == [None] else max(levels)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 10.0), pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await _discover(client, models_url, headers, args.model)

        def payload(p: BenchPrompt) -> dict[str, Any]:
            return bc.build_payload(kind, model, p.prompt, p.output_len, args.temperature,
                                    args.ignore_eos, stream=args.stream)

        if args.warmup:
            warm = random_word_prompts(1, 8, min(4, prompts[0].output_len), seed=args.seed + 1)[0]
            rec = await bc.send_request(client, url, payload(warm), -1, warm, headers)
            if not rec.success:
                raise BenchError(f"warm-up request to {url} failed: {rec.error}")

        runs = []
        for c in levels:
            # Random prompts: each level sends max(--num-prompts, c) of them; a dataset is
            # sent whole at every level.
            level_prompts = (prompts if args.dataset is not None or c is None
                             else prompts[:max(args.num_prompts, c)])
            summary, records, t0, metrics = await _run_level(
                args, client, url, model, level_prompts, payload, headers, c)
            print(report.format_table(summary))
            runs.append({"concurrency": c, "summary": summary, "records": records, "t0": t0})

    config = _config(args, url, model, kind, len(runs[0]["records"]))
    if args.sweep_concurrency is None:
        if args.json_path:
            report.write_json(args.json_path, config, runs[0]["summary"], runs[0]["records"],
                              runs[0]["t0"])
        if args.plot:
            _plot_run(args, runs[0], model)
        return 0 if runs[0]["summary"]["completed"] else 1
    _finish_sweep(args, config, runs, metrics, model)
    return 0 if all(r["summary"]["completed"] for r in runs) else 1


def _finish_sweep(args, config, runs, metrics, model) -> None:
    """The sweep's one-line-per-level table, its JSON and its picture."""
    import json
    from pathlib import Path

    from servelm.bench import report, sweep

    roof = sweep.RooflineModel.from_metrics(metrics)
    in_len, out_len = args.input_len, args.output_len
    print(f"{'conc':>5}{'tok/s':>10}{'TTFT p50':>11}{'TPOT p50':>11}"
          + (f"{'ideal tok/s':>13}" if roof and in_len and out_len else ""))
    for r in runs:
        s = r["summary"]
        ttft, tpot = s["ttft_ms"], s["tpot_ms"]
        line = (f"{r['concurrency']:>5}{s['output_throughput']:>10.1f}"
                f"{(ttft['p50'] if ttft else float('nan')):>9.1f}ms"
                f"{(tpot['p50'] if tpot else float('nan')):>9.1f}ms")
        if roof and in_len and out_len:
            r["roofline"] = roof.predict(r["concurrency"], in_len, out_len)
            line += f"{r['roofline']['output_throughput']:>13.1f}"
        print(line)
    if args.json_path:
        doc = {"config": config,
               "levels": [{"concurrency": r["concurrency"], "summary": r["summary"],
                           "roofline": r.get("roofline"),
                           "requests": [report.record_dict(x, r["t0"]) for x in r["records"]]}
                          for r in runs]}
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        shape = (f"{in_len} in / {out_len} out" if in_len and out_len
                 else f"dataset {args.dataset}")
        sweep.plot_sweep(runs, args.plot, f"servelm bench: {model}, {shape}, "
                         f"max({args.num_prompts}, concurrency) requests per level",
                         roof, in_len, out_len)
        print(f"servelm bench: wrote {args.plot}", file=sys.stderr)


def _plot_run(args, run, model) -> None:
    """The single run's picture: latency distributions and throughput over time."""
    from servelm.bench import plot

    shape = (f"{args.input_len} in / {args.output_len} out" if args.dataset is None
             else f"dataset {args.dataset}")
    mode = (f"concurrency {args.concurrency}" if args.concurrency is not None
            else f"request rate {args.request_rate:g}/s")
    s = run["summary"]
    series = plot.run_series(run["records"], run["t0"], s["duration_s"])
    plot.plot_run(series, args.plot, f"servelm bench: {model}, {shape}, {mode}, "
                  f"{s['completed']} of {len(run['records'])} requests completed")
    print(f"servelm bench: wrote {args.plot}", file=sys.stderr)


async def _run_level(args, client, url, model, prompts, payload, headers, concurrency):
    """One timed run at a fixed concurrency (or at --request-rate when it is None)."""
    import gc
    import time

    from tqdm import tqdm

    from servelm.bench import client as bc
    from servelm.bench import report
    from servelm.bench.runner import run_requests

    mode = (f"concurrency {concurrency}" if concurrency is not None
            else f"request rate {args.request_rate:g}/s")
    print(f"servelm bench: {len(prompts)} requests to {url} (model {model}), {mode}",
          file=sys.stderr)
    bar = tqdm(total=len(prompts), unit="req", file=sys.stderr,
               disable=not args.progress or not sys.stderr.isatty())

    async def send(i: int, p):
        return await bc.send_request(client, url, payload(p), i, p, headers)

    # The process holds all of torch's objects (servelm imports it); a full collection
    # over them stalls the event loop for 100+ ms mid-run and shows up as fake latency.
    # Frozen objects are skipped by the collector.
    metrics_url = url.split("/v1/")[0] + "/metrics"
    before = await _scrape_servelm(client, metrics_url, headers)
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    try:
        records, duration = await run_requests(
            prompts, send, concurrency=concurrency,
            request_rate=args.request_rate or math.inf, seed=args.seed,
            on_done=lambda _: bar.update(1))
    finally:
        gc.unfreeze()
        bar.close()
    after = await _scrape_servelm(client, metrics_url, headers) if before else None
    summary = report.summarize(records, duration, args.slo)
    summary["server"] = report.server_utilization(before, after)
    return summary, records, t0, after


def run_bench(args) -> int:
    """Run a benchmark from parsed `bench` arguments; the process exit status."""
    import asyncio

    from servelm.bench.client import endpoint_kind

    try:
        apply_defaults(args)
        _check_args(args)
        try:
            kind = endpoint_kind(args.endpoint)
        except ValueError as e:
            raise BenchError(str(e)) from None
        url, models_url = _urls(args.base_url, args.endpoint)
        prompts = _prompts(args, kind)
        return asyncio.run(_bench(args, prompts, kind, url, models_url))
    except (BenchError, OSError) as e:
        print(f"servelm bench: error: {e}", file=sys.stderr)
        return 2
