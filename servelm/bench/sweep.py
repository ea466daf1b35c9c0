"""`servelm bench --sweep-concurrency`: the roofline's ideal curve and the picture.

The prediction needs the model's side of the roofline (weight bytes per decode step, KV
bytes and FLOPs per token) and the machine's (bandwidth, matmul peak); a servelm server
exports both on /metrics. For a concurrency c, prompts of I tokens and outputs of O:

- one prefill reads the weights once and does I tokens' FLOPs: t_pre = max(bytes/BW, FLOPs/peak);
- one decode step of c sequences at the mean context I + O/2: t_dec, likewise;
- each request costs one prefill and O decode steps shared by c, so the ideal output
  throughput is c*O / (c*t_pre + O*t_dec); ideal TTFT is t_pre and ideal TPOT is t_dec.

These are lower bounds for latency and an upper bound for throughput: no queueing, no
overhead, prefill never delaying decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from servelm.roofline import prompt_flops

_METRIC = "servelm_roofline_"


@dataclass(frozen=True)
class RooflineModel:
    weight_bytes: float          # per decode step
    kv_bytes_per_token: float
    flops_per_token: float       # without attention
    attn_flops_per_context: float  # per token per earlier token attended
    bandwidth: float             # bytes/s
    peak_flops: float            # FLOP/s
    # Within flops_per_token, what a prompt runs for its last position only (the LM head,
    # the last layer past attention).
    sampled_row_flops: float = 0.0

    @classmethod
    def from_metrics(cls, m: dict[str, float] | None) -> "RooflineModel | None":
        """From a servelm server's scraped /metrics; None when any figure is missing."""
        if not m:
            return None
        names = ("weight_bytes_per_step", "kv_bytes_per_token", "flops_per_token",
                 "attention_flops_per_token_context", "bandwidth_bytes_per_second",
                 "flops_per_second")
        vals = [m.get(_METRIC + n) for n in names]
        if any(v is None for v in vals) or not vals[4] or not vals[5]:
            return None
        # Older servers export only the LM head's share.
        tail = m.get(_METRIC + "sampled_row_flops_per_token",
                     m.get(_METRIC + "lm_head_flops_per_token", 0.0))
        return cls(*vals, sampled_row_flops=tail)

    def _time(self, bytes_: float, flops: float) -> float:
        return max(bytes_ / self.bandwidth, flops / self.peak_flops)

    def prefill_seconds(self, prompt_len: int) -> float:
        flops = prompt_flops(prompt_len, self.flops_per_token
                             + self.attn_flops_per_context * prompt_len / 2, self.sampled_row_flops)
        return self._time(self.weight_bytes + prompt_len * self.kv_bytes_per_token, flops)

    def decode_step_seconds(self, batch: int, context: float) -> float:
        flops = batch * (self.flops_per_token + self.attn_flops_per_context * context)
        return self._time(self.weight_bytes + batch * context * self.kv_bytes_per_token, flops)

    def predict(self, concurrency: int, input_len: int, output_len: int) -> dict[str, float]:
        """Ideal output tok/s, TTFT and TPOT (seconds) at this concurrency."""
        t_pre = self.prefill_seconds(input_len)
        t_dec = self.decode_step_seconds(concurrency, input_len + output_len / 2)
        tput = concurrency * output_len / (concurrency * t_pre + output_len * t_dec)
        return {"output_throughput": tput, "ttft_s": t_pre, "tpot_s": t_dec}


def plot_sweep(levels: Sequence[dict[str, Any]], path: str, title: str,
               roofline: RooflineModel | None = None, input_len: int | None = None,
               output_len: int | None = None) -> None:
    """Three panels against concurrency: output tok/s, TTFT and TPOT (p50, with p99 as a
    dashed line), and the roofline's ideal on the same axes when it is known.

    levels: [{"concurrency": c, "summary": report.summarize(...)}, ...]
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [lv["concurrency"] for lv in levels]
    sums = [lv["summary"] for lv in levels]

    def lat(name: str, q: str) -> list[float | None]:
        return [s[f"{name}_ms"][q] if s[f"{name}_ms"] else None for s in sums]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.plot(cs, [s["output_throughput"] for s in sums], "o-", label="measured")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    for ax, name, label in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        ax.plot(cs, lat(name, "p50"), "o-", label="measured p50")
        ax.plot(cs, lat(name, "p99"), "o--", alpha=0.6, label="measured p99")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
    if roofline is not None and input_len and output_len:
        pred = [roofline.predict(c, input_len, output_len) for c in cs]
        axes[0].plot(cs, [p["output_throughput"] for p in pred], "k:", label="roofline (ideal)")
        axes[1].plot(cs, [1000 * p["ttft_s"] for p in pred], "k:", label="roofline (ideal)")
        axes[2].plot(cs, [1000 * p["tpot_s"] for p in pred], "k:", label="roofline (ideal)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency")
    save_figure(fig, axes, path, title)


def save_figure(fig, axes, path: str, title: str) -> None:
    """The bench figures' common finish: grids, legends, the title, a PNG at path."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
