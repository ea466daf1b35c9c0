"""Aggregate statistics over request records, the printed table and the JSON file."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from servelm.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")
MAX_ERRORS_SHOWN = 5


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics.

    The same definition as numpy.percentile's default, so numbers compare with other tools.
    """
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean and p50/p90/p99 in milliseconds of values in seconds; None when there are none."""
    if not values_s:
        return None
    out = {"mean": 1000 * sum(values_s) / len(values_s)}
    for q in PERCENTILES:
        out[f"p{q}"] = 1000 * percentile(values_s, q)
    return out


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=0.5,tpot=50ms,e2e=2s' -> {'ttft': 0.5, 'tpot': 0.05, 'e2e': 2.0} (seconds).

    Plain numbers are seconds. Raises ValueError naming the bad part.
    """
    slo: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"bad SLO {part!r}: expected NAME=SECONDS with NAME one of "
                             f"{', '.join(SLO_METRICS)}")
        scale = 1.0
        if value.endswith("ms"):
            value, scale = value[:-2], 1e-3
        elif value.endswith("s"):
            value = value[:-1]
        try:
            seconds = float(value) * scale
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number") from None
        if not seconds > 0 or math.isinf(seconds):
            raise ValueError(f"bad SLO {part!r}: must be a positive time")
        slo[key] = seconds
    if not slo:
        raise ValueError("empty SLO: expected e.g. ttft=0.5,tpot=0.05")
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request is within every given limit.

    A one-token output has no TPOT and so cannot miss a TPOT limit.
    """
    if not rec.success:
        return False
    for key, limit in slo.items():
        value = getattr(rec, key)
        if value is not None and value > limit:
            return False
    return True


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    """Most requests open at once, from their start and end times."""
    events = []
    for r in records:
        if r.e2e is not None:
            # Ends sort before starts at the same instant: back-to-back is not overlap.
            events.append((r.start, 1))
            events.append((r.start + r.e2e, -1))
    peak = now = 0
    for _, d in sorted(events):
        now += d
        peak = max(peak, now)
    return peak


def summarize(records: Sequence[RequestRecord], duration: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Every aggregate number of a run: counts, throughputs, latency stats, goodput, errors."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = max(duration, 1e-9)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error or "unknown error" for r in failed)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "peak_concurrency": peak_in_flight(records),
        "ttft_ms": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": latency_stats([x for r in ok for x in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in ok if r.e2e is not None]),
        "slo": slo,
        "good_requests": None,
        "goodput": None,
        # Counter keeps first-seen order, so ties list the earliest error first.
        "errors": [{"message": m, "count": c} for m, c in errors.most_common(MAX_ERRORS_SHOWN)],
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["good_requests"] = good
        summary["goodput"] = good / dur
    return summary


def server_utilization(before: dict[str, float] | None,
                       after: dict[str, float] | None) -> dict[str, float] | None:
    """What a servelm server achieved during the run against its roofline, from its
    /metrics counters before and after: decode bandwidth and prefill FLOP/s."""
    if not before or not after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out: dict[str, float] = {}
    bw = after.get("servelm_roofline_bandwidth_bytes_per_second")
    peak = after.get("servelm_roofline_flops_per_second")
    dec_s, pre_s = delta("servelm_decode_step_seconds_total"), delta("servelm_prefill_step_seconds_total")
    if dec_s > 0:
        out["decode_bandwidth_gb_s"] = delta("servelm_decode_step_bytes_total") / dec_s / 1e9
        if bw:
            out["decode_bandwidth_utilization"] = out["decode_bandwidth_gb_s"] * 1e9 / bw
    drafts = delta("servelm_spec_decode_num_draft_tokens_total")
    if drafts > 0:  # speculative decoding during the run
        accepted = delta("servelm_spec_decode_num_accepted_tokens_total")
        out["spec_acceptance_rate"] = accepted / drafts
        verified = delta("servelm_spec_decode_num_drafts_total")
        if verified > 0:
            out["spec_mean_accepted_length"] = 1 + accepted / verified
    if pre_s > 0:
        out["prefill_tflops"] = delta("servelm_prefill_step_flops_total") / pre_s / 1e12
        if peak:
            out["prefill_flops_utilization"] = out["prefill_tflops"] * 1e12 / peak
    return out or None


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable report: aligned plain text."""
    width = 50
    lines = [" Benchmark result ".center(width, "=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        text = "-" if value is None else format(value, fmt)
        lines.append(f"{label:<34}{text:>16}")

    row("Successful requests", summary["completed"])
    row("Failed requests", summary["failed"])
    row("Duration (s)", summary["duration_s"], ".2f")
    row("Peak concurrent requests", summary["peak_concurrency"])
    row("Total input tokens", summary["total_input_tokens"])
    row("Total output tokens", summary["total_output_tokens"])
    row("Request throughput (req/s)", summary["request_throughput"], ".2f")
    row("Output token throughput (tok/s)", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s)", summary["total_token_throughput"], ".2f")
    if summary.get("slo"):
        limits = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in summary["slo"].items())
        row("Good requests", summary["good_requests"])
        row("Goodput (req/s)", summary["goodput"], ".2f")
        lines.append(f"  SLO: {limits}")
    lines.append(" Latency (ms) ".center(width, "-"))
    cols = ["mean"] + [f"p{q}" for q in PERCENTILES]
    lines.append(f"{'':<10}" + "".join(f"{c:>10}" for c in cols))
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[f"{name}_ms"]
        cells = ["-" if stats is None else f"{stats[c]:.2f}" for c in cols]
        lines.append(f"{name.upper():<10}" + "".join(f"{c:>10}" for c in cells))
    server = summary.get("server")
    if server:
        lines.append(" Server vs its roofline ".center(width, "-"))
        for key, label, fmt in (
                ("decode_bandwidth_gb_s", "Decode bandwidth (GB/s)", ".1f"),
                ("decode_bandwidth_utilization", "Decode bandwidth utilisation", ".1%"),
                ("prefill_tflops", "Prefill (TFLOP/s)", ".3f"),
                ("prefill_flops_utilization", "Prefill FLOP utilisation", ".1%"),
                ("spec_acceptance_rate", "Speculation: draft acceptance", ".1%"),
                ("spec_mean_accepted_length", "Speculation: tokens/verification", ".2f")):
            if key in server:
                row(label, server[key], fmt)
    if summary["errors"]:
        lines.append(" Errors ".center(width, "-"))
        for e in summary["errors"]:
            lines.append(f"  {e['count']} x {e['message']}")
    lines.append("=" * width)
    return "\n".join(lines)


def record_dict(rec: RequestRecord, t0: float) -> dict[str, Any]:
    """One request for the JSON file; start_s is relative to the run's start t0."""
    return {
        "index": rec.index,
        "success": rec.success,
        "error": rec.error,
        "prompt_tokens": rec.prompt_tokens,
        "output_tokens": rec.output_tokens,
        "requested_output_tokens": rec.output_len,
        "start_s": rec.start - t0,
        "ttft_s": rec.ttft,
        "tpot_s": rec.tpot,
        "e2e_s": rec.e2e,
        "itl_s": rec.itl,
    }


def write_json(path: str | Path, config: dict[str, Any], summary: dict[str, Any],
               records: Sequence[RequestRecord], t0: float) -> None:
    """{"config": ..., "summary": ..., "requests": [...]} to path."""
    doc = {"config": config, "summary": summary,
           "requests": [record_dict(r, t0) for r in records]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
