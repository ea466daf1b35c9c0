"""GET /v1/stats: the engine's state, its rates and where its steps sit on the roofline, as
JSON for the web console (no Prometheus text to parse).

Everything comes from what the server already keeps: the snapshot the engine thread publishes
after every step (EngineSnapshot and a copy of its EngineStats counters), the finished
requests' TTFT and TPOT (ServerMetrics), the model's ModelShape and the machine's Hardware,
measured once while the engine was built (launcher) or given by flags. Rates and the
roofline's current points are differences between this call's counters and those an earlier
call saw, up to WINDOW seconds ago; with no such call yet they are null, and the totals since
start still stand.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import fields
from typing import Callable, Iterable

from servelm.engine.engine import EngineStats
from servelm.roofline import ridge_tokens

WINDOW = 3.0        # seconds: the longest span a rate is taken over
MIN_SPAN = 0.25     # seconds: a shorter span gives no rate (too few steps to mean much)
PERCENTILES = (50, 90, 99)


def percentiles(values: Iterable[float]) -> dict[str, float] | None:
    """Nearest-rank p50/p90/p99 of `values`; None when there are none."""
    v = sorted(values)
    if not v:
        return None
    return {f"p{p}": v[max(0, math.ceil(p / 100 * len(v)) - 1)] for p in PERCENTILES}


def phase_point(num_bytes: float, flops: float, seconds: float, hw) -> dict | None:
    """Where steps that read `num_bytes` and did `flops` in `seconds` sit on the roofline:
    achieved bandwidth and FLOP/s, arithmetic intensity, and (given the machine) which roof
    binds them and how close to it they ran. None when no such step ran."""
    if seconds <= 0 or num_bytes <= 0:
        return None
    point = {"seconds": seconds, "bandwidth": num_bytes / seconds, "flops": flops / seconds,
             "intensity": flops / num_bytes, "bound": None, "utilization": None}
    if hw is not None:
        memory = point["intensity"] < hw.flops / hw.bandwidth  # left of the ridge
        point["bound"] = "memory" if memory else "compute"
        point["utilization"] = (point["bandwidth"] / hw.bandwidth if memory
                                else point["flops"] / hw.flops)
    return point


def queued_tokens(scheduler) -> tuple[int, int]:
    """The tokens of the running requests (their contexts so far) and those the waiting
    ones still have to compute: the load a router weighs. Each list is copied whole first
    (one C call, during which no engine step runs), so the counts are at most a step old."""
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    return (sum(r.num_tokens for r in running),
            sum(r.num_tokens - r.num_computed_tokens for r in waiting))


class LiveStats:
    """Builds /v1/stats reports; remembers the counters of recent calls for the rates."""

    def __init__(self, engine, metrics, model_name: str,
                 clock: Callable[[], float] = time.monotonic):
        self._engine = engine      # the AsyncLLMEngine
        self._metrics = metrics    # ServerMetrics
        self._model_name = model_name
        self._clock = clock
        self._seen: deque[tuple[float, EngineStats]] = deque()

    def _base(self, now: float, stats: EngineStats) -> tuple[float, EngineStats] | None:
        """The oldest counters seen within WINDOW (None if all are too recent); remembers
        these, at most one entry per MIN_SPAN."""
        while self._seen and now - self._seen[0][0] > WINDOW:
            self._seen.popleft()
        base = self._seen[0] if self._seen and now - self._seen[0][0] >= MIN_SPAN else None
        if not self._seen or now - self._seen[-1][0] >= MIN_SPAN:
            self._seen.append((now, stats))
        return base

    def report(self) -> dict:
        """The whole report (cheap: it reads published numbers, and sorts at most
        RECENT_REQUESTS timings twice)."""
        snap = self._engine.snapshot
        st = snap.stats
        now = self._clock()
        base = self._base(now, st)
        llm = self._engine.engine
        hw = getattr(llm, "hardware", None)
        shape = llm.shape
        bm = llm.block_manager
        lora = getattr(llm, "lora", None)  # the LoRAManager, when adapters are served
        span = now - base[0] if base else None
        d = _delta(st, base[1]) if base else None

        def rate(count: float) -> float | None:
            return count / span if span else None

        def phase(name: str) -> dict:
            """The phase's point over the window (None without one) and since start."""
            def point(s: EngineStats) -> dict | None:
                return phase_point(getattr(s, f"{name}_bytes"), getattr(s, f"{name}_flops"),
                                   getattr(s, f"{name}_seconds"), hw)

            return {"current": point(d) if d else None, "total": point(st)}

        prefill_steps = st.num_steps - st.num_decode_steps
        sched = getattr(llm, "scheduler", None)  # None: an engine stub without one
        running_tokens, waiting_tokens = queued_tokens(sched) if sched else (None, None)
        return {
            "object": "servelm.stats",
            "model": self._model_name,
            "window_s": span,
            "requests": {"running": snap.num_running, "waiting": snap.num_waiting,
                         "preemptions": snap.num_preemptions, "aborted": st.num_aborted,
                         "running_tokens": running_tokens, "waiting_tokens": waiting_tokens},
            "kv_cache": {"blocks_used": round(snap.kv_cache_usage * bm.num_blocks),
                         "blocks_total": bm.num_blocks, "block_size": bm.block_size,
                         "usage": snap.kv_cache_usage,
                         "capacity_tokens": bm.num_blocks * bm.block_size,
                         "bytes_per_token": shape.kv_bytes_per_token,
                         "max_model_len": llm.max_model_len},
            "lora": None if lora is None else {
                "loaded": list(self._engine.loras), "resident": list(snap.lora_resident),
                "max_loras": lora.max_loras, "slot_bytes": lora.slot_bytes(),
                "loads": snap.lora_loads},
            "prefix_cache": {"queried_tokens": snap.prefix_cache_queries,
                             "hit_tokens": snap.prefix_cache_hits,
                             "hit_rate": (snap.prefix_cache_hits / snap.prefix_cache_queries
                                          if snap.prefix_cache_queries else None)},
            "tokens": {"prompt": st.num_prefill_tokens, "generated": st.num_generated_tokens,
                       "prompt_per_s": rate(d.num_prefill_tokens) if d else None,
                       "generated_per_s": rate(d.num_generated_tokens) if d else None,
                       "steps": st.num_steps, "prefill_steps": prefill_steps,
                       "decode_steps": st.num_decode_steps},
            "latency": {"requests": len(self._metrics.recent_ttft),
                        "ttft_s": percentiles(self._metrics.recent_ttft),
                        "tpot_s": percentiles(self._metrics.recent_tpot)},
            "roofline": {
                "machine": None if hw is None else {
                    "bandwidth": hw.bandwidth, "flops": hw.flops,
                    "ridge": hw.flops / hw.bandwidth, "source": hw.source,
                    "int8_ops": hw.int8_ops, "q8act_ops": hw.q8act_ops,
                    "w8a8_ops": hw.w8a8_ops},
                # Tokens a step computes per weight read where arithmetic starts to bound
                # it: a prompt chunk past it stalls the decodes it shares a step with.
                "ridge_tokens": None if hw is None else ridge_tokens(shape, hw),
                "weight_bytes_per_step": shape.weight_bytes_per_step,
                "decode": phase("decode"),
                "prefill": phase("prefill"),
            },
        }


def cache_events(llm, since: int | None, keyed: bool) -> dict:
    """GET /v1/cache_events: the prefix cache's "stored" / "removed" block digests
    (block_manager.block_digest, 16 hex digits) after event `since`, in order; "reset" true
    (and "blocks": every digest cached now, instead of events) when the log no longer holds
    them all, `since` is missing, or it is another instance's (a restarted server).
    keyed: whether the server has API keys, each its own cache salt (a router computing
    digests needs to know)."""
    bm = llm.block_manager
    log = bm.events
    out = {"object": "servelm.cache_events", "enabled": log is not None,
           "block_size": bm.block_size, "keyed": keyed,
           "instance": log.instance if log else None}
    if log is None:
        return {**out, "seq": 0, "reset": False, "events": []}
    seq, events, blocks = log.since(since)
    if events is None:
        return {**out, "seq": seq, "reset": True, "events": [],
                "blocks": [f"{d:016x}" for d in blocks]}
    return {**out, "seq": seq, "reset": False,
            "events": [[kind, f"{d:016x}"] for kind, d in events]}


def _delta(now: EngineStats, then: EngineStats) -> EngineStats:
    """The counters' growth from `then` to `now`."""
    return EngineStats(**{f.name: getattr(now, f.name) - getattr(then, f.name)
                          for f in fields(EngineStats)})
