"""`servelm bench --plot` for one run: its latency distributions and its throughput over time.

Everything comes from the client's request records. A token's arrival time is its request's
start plus TTFT plus the inter-token gaps before it; tokens the client could not time one by
one (an answer that was not streamed, or chunks of several tokens without per-chunk usage)
are counted at the last chunk's arrival, when the client saw them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from servelm.bench.client import RequestRecord
from servelm.bench.sweep import save_figure

# Buckets of the throughput-over-time panel: a second each, finer for runs too short to
# fill MIN_BUCKETS of them.
MIN_BUCKETS = 10
_FINER_WIDTHS = (0.5, 0.25, 0.1, 0.05, 0.025, 0.01)


@dataclass(frozen=True)
class RunSeries:
    """The series the single-run plot draws. Latencies in ms; times in s from the run's start.

    bucket_tokens[i] counts output tokens that arrived in [i * bucket_s, (i + 1) * bucket_s);
    over a run they sum to its successful requests' output tokens.
    """

    ttft_ms: list[float]
    tpot_ms: list[float]
    itl_ms: list[float]
    duration_s: float
    bucket_s: float
    bucket_tokens: list[int]

    @property
    def bucket_rates(self) -> list[float]:
        """Output tokens/s in each bucket (the last one's over its full width, though the
        run may end inside it)."""
        return [n / self.bucket_s for n in self.bucket_tokens]


def token_times(rec: RequestRecord, t0: float) -> list[float]:
    """Arrival time (s from t0) of each of a successful request's output tokens; [] for a
    failed one or one without a first token."""
    if not rec.success or rec.ttft is None:
        return []
    t = rec.start - t0 + rec.ttft
    times = [t]
    for gap in rec.itl:
        t += gap
        times.append(t)
    # Tokens that came together with the last chunk.
    times.extend([t] * (rec.output_tokens - len(times)))
    return times[:max(rec.output_tokens, 1)]


def bucket_width(duration: float) -> float:
    """One second, or the widest of a few finer widths that gives MIN_BUCKETS buckets."""
    if duration >= MIN_BUCKETS:
        return 1.0
    for w in _FINER_WIDTHS:
        if duration / w >= MIN_BUCKETS:
            return w
    return _FINER_WIDTHS[-1]


def throughput_buckets(records: Sequence[RequestRecord], t0: float, duration: float,
                       bucket_s: float) -> list[int]:
    """Output tokens per bucket_s-wide bucket from t0 over duration (at least one bucket).

    A token timed at or past the end (clock rounding) falls in the last bucket.
    """
    n = max(1, math.ceil(duration / bucket_s))
    counts = [0] * n
    for rec in records:
        for t in token_times(rec, t0):
            counts[min(max(int(t / bucket_s), 0), n - 1)] += 1
    return counts


def run_series(records: Sequence[RequestRecord], t0: float, duration: float) -> RunSeries:
    """What plot_run draws, from one run's records, its start t0 and its wall time."""
    ok = [r for r in records if r.success]
    width = bucket_width(duration)
    return RunSeries(
        ttft_ms=[1000 * r.ttft for r in ok if r.ttft is not None],
        tpot_ms=[1000 * r.tpot for r in ok if r.tpot is not None],
        itl_ms=[1000 * x for r in ok for x in r.itl],
        duration_s=duration,
        bucket_s=width,
        bucket_tokens=throughput_buckets(ok, t0, duration, width))


def _cdf(ax, values_ms: Sequence[float], label: str, style: str = "-") -> None:
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    # From 0 at the smallest sample, so the first step shows.
    ax.step([xs[0]] + xs, [0.0] + ys, style, where="post", label=f"{label} (n={len(xs)})")


def plot_run(series: RunSeries, path: str, title: str) -> None:
    """Three panels: the CDF of TTFT, the CDFs of TPOT and ITL, and output tokens/s per
    bucket over the run with its mean; a PNG at path (matplotlib's Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, lines, name in ((axes[0], (("TTFT", series.ttft_ms, "-"),), "TTFT"),
                            (axes[1], (("TPOT", series.tpot_ms, "-"),
                                       ("ITL", series.itl_ms, "--")), "TPOT and ITL")):
        drawn = False
        for label, values, style in lines:
            if values:
                _cdf(ax, values, label, style)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} distribution")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="lower right")

    ax = axes[2]
    w = series.bucket_s
    starts = [i * w for i in range(len(series.bucket_tokens))]
    ax.bar(starts, series.bucket_rates, width=w, align="edge", alpha=0.7,
           label=f"per {w:g} s bucket")
    mean = sum(series.bucket_tokens) / max(series.duration_s, 1e-9)
    ax.axhline(mean, color="k", linestyle=":", label=f"run mean {mean:.1f} tok/s")
    ax.set_xlim(0, len(series.bucket_tokens) * w)
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput over time")
    save_figure(fig, [ax], path, title)
