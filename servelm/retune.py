"""The linear-method table checked after start-up, and measured again while the engine idles.

finalize_linears (servelm.tuning) serves a table whose timings stayed unstable (a busy
machine) without caching it: TuningReport.provisional. A cached table can be wrong too
(tuned under a load the stability checks did not see). The engine keeps one IdleRetuner
(built once, from the report's RetunePlan, where KernelConfig.retune_when_idle is on):

    DriftMonitor   each decode-only step's seconds over the table's prediction for its
                   rows (the chosen methods' measured µs summed over the layers), the median
                   of a window of DRIFT_STEPS steps of one row bucket, against that bucket's
                   reference: the first window's median on a trusted table, cached
                   beside it (STEP_KEY, per table: its shapes and methods). A window DRIFT
                   times under it (steps now that much faster against the table's times:
                   they were inflated, timed on a busier machine) marks the table suspect.
                   (Slower steps are not judged: a longer context alone makes them slower.)
                   A reference is learned only while the engine is the process's only one
                   that tunes: two engines stepping in turn evict each other's weights from
                   the caches, so their steps run slower than either's alone, and a
                   reference learned so read a later lone engine's normal steps as 1.5x
                   "faster" (a benchmark's two formats in one process).
    IdleRetuner    a provisional or suspect table measured again once the engine has been
                   idle IDLE_AFTER_S (no running or waiting requests: LLMEngine.commit_idle),
                   one piece per call (a method built, a bucket timed, ...), so a request
                   arriving waits for one piece at most; each shape on a fresh layer of its
                   format and size (tuning.synthetic_source). A result whose timings are
                   stable (each shape's, and the shapes' rates against each other as at
                   start-up) is written to the cache, for the next start; the running engine
                   keeps its table (its DecodeStack bound the layers' weights at build time).
                   At most MAX_RETUNES attempts a process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import weakref
from collections import deque

from servelm import tuning
from servelm.config import KernelConfig
from servelm.layers import linear_methods as lm
from servelm.quantization.numerics import unpacked_once
from servelm.tuning_cache import TuningCache
from servelm.tuning_cache import times_from as tuning_times

logger = logging.getLogger(__name__)

DRIFT = 1.3          # a window this many times under its reference: the table's times are off
DRIFT_STEPS = 256    # ... judged on the median of this many decode steps of one row bucket
IDLE_AFTER_S = 30.0  # idle this long (no step) before a re-tune's piece runs
IDLE_POLL_S = 0.01   # while waiting for that: the engine thread's sleep per idle call
MAX_RETUNES = 3      # attempts a process makes (a machine busy for good stays provisional)
STEP_KEY = "decode/step_ratio"  # + ":<table fingerprint>": DriftMonitor's references
_LIVE: "weakref.WeakSet[IdleRetuner]" = weakref.WeakSet()  # this process's engines' re-tuners


def table_fingerprint(report: tuning.TuningReport) -> str:
    """What a step-time reference belongs to: the table's shapes and their methods."""
    text = json.dumps([(s.key, s.methods) for s in report.shapes], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predicted_us(report: tuning.TuningReport) -> list[float]:
    """Per row bucket, the table's linear time for a call of BUCKET_ROWS[b] rows through
    every layer: each shape's chosen method's measured µs times its layers (inf where a
    chosen method has no finite time there)."""
    out = []
    for b in range(len(lm.BUCKET_ROWS)):
        total = 0.0
        for sc in report.shapes:
            t = sc.times_us.get(sc.methods[b])
            total += len(sc.names) * (t[b] if t is not None else math.inf)
        out.append(total)
    return out


class DriftMonitor:
    """Decode step times against the table's prediction (predicted: µs per bucket's row
    count, predicted_us): per bucket the median of a window of steps' ratio to it, against
    reference[b] (None: the first window's median becomes it, if learn, and alone() says
    the engine steps alone in its process; a window that is not alone is not learned from).
    record(rows, seconds) -> whether this step turned it suspect; `learned`: the buckets
    whose reference a window set."""

    def __init__(self, predicted: list[float], reference: list[float | None] | None = None,
                 bound: float = DRIFT, window: int = DRIFT_STEPS, learn: bool = True,
                 alone=lambda: True):
        self.predicted = predicted
        self.reference = list(reference) if reference else [None] * len(lm.BUCKET_ROWS)
        self.bound = bound
        self.window = window
        self.learn = learn
        self.alone = alone
        self.learned: list[int] = []
        self.ratios = [deque(maxlen=window) for _ in lm.BUCKET_ROWS]
        self.suspect: str | None = None  # why, once it fired

    def predict_us(self, rows: int) -> float:
        """The table's linear µs for a call of `rows` rows: linear between the buckets' row
        counts (at most the first bucket's below it, scaled by the rows past the last)."""
        r, p = lm.BUCKET_ROWS, self.predicted
        if rows <= r[0]:
            return p[0]
        for b in range(len(r) - 1):
            if rows <= r[b + 1]:
                f = (rows - r[b]) / (r[b + 1] - r[b])
                return p[b] + f * (p[b + 1] - p[b])
        return p[-1] * rows / r[-1]

    def record(self, rows: int, seconds: float) -> bool:
        if self.suspect is not None or rows < 1:
            return False
        want = self.predict_us(rows)
        if not (math.isfinite(want) and want > 0):
            return False
        b = lm.bucket_of(rows)
        ratios = self.ratios[b]
        ratios.append(seconds * 1e6 / want)
        if len(ratios) < self.window:
            return False
        median = sorted(ratios)[len(ratios) // 2]
        ratios.clear()  # windows do not overlap
        ref = self.reference[b]
        if ref is None or not math.isfinite(ref):
            if self.learn and self.alone():
                self.reference[b] = median
                self.learned.append(b)
            return False
        if median * self.bound < ref:
            self.suspect = (f"decode steps of the {lm.BUCKET_ROWS[b]}-row bucket ran "
                            f"{ref / median:.2f}x faster against the table's times than when "
                            f"it was trusted (median of {self.window} steps)")
            return True
        return False


class IdleRetuner:
    """A provisional or suspect table measured again in the engine's idle time (module
    docstring). record(sched, seconds) after every step; idle_piece() when the engine has
    nothing to run: whether it wants to be called again."""

    def __init__(self, plan: tuning.RetunePlan, provisional: bool, predicted: list[float],
                 idle_after: float = IDLE_AFTER_S, clock=time.monotonic, sleep=time.sleep,
                 fingerprint: str = ""):
        self.plan = plan
        self.step_key = f"{STEP_KEY}:{fingerprint}"
        entry = None if provisional else TuningCache(plan.cache_dir, plan.machine).get(
            self.step_key)
        reference = tuning_times(entry)["ratio"] if entry else None
        # (A provisional table's times are not trusted: no reference is learned from them.)
        self.drift = DriftMonitor(predicted, reference, learn=not provisional,
                                  alone=lambda: len(_LIVE) == 1)
        _LIVE.add(self)
        self.pending: str | None = "provisional" if provisional else None  # why, if due
        self.idle_after = idle_after
        self.clock, self.sleep = clock, sleep
        self.last_busy = clock()
        self.attempts = 0
        self.written = False  # a re-tuned table reached the cache
        self._job = None

    @classmethod
    def of(cls, report: tuning.TuningReport, kernels: KernelConfig) -> "IdleRetuner | None":
        """The engine's re-tuner: None where nothing was tuned (no plan) or it is off."""
        if report.plan is None or not kernels.retune_when_idle:
            return None
        return cls(report.plan, report.provisional, predicted_us(report),
                   fingerprint=table_fingerprint(report))

    def record(self, sched, seconds: float) -> None:
        """A step ran (sched: the scheduler's output): the engine is busy; a decode-only
        step's time goes to the drift check."""
        self.last_busy = self.clock()
        decode = all(s.num_new_tokens == 1 and not s.num_draft
                     and s.start >= s.request.num_prompt_tokens for s in sched.scheduled)
        if decode and sched.scheduled:
            self.record_decode(len(sched.scheduled), seconds)

    def record_decode(self, rows: int, seconds: float) -> None:
        suspect = self.drift.record(rows, seconds)
        if self.drift.learned:  # a bucket's reference: cached beside the table
            self.drift.learned.clear()
            cache = TuningCache(self.plan.cache_dir, self.plan.machine)
            cache.put(self.step_key, {"ratio": [math.inf if r is None else r
                                                for r in self.drift.reference]}, [], [], [])
            cache.save()
        if suspect and self.pending is None:
            self.pending = self.drift.suspect
            logger.warning("the linear-method table looks wrong: %s; it is measured again "
                           "when the engine is idle", self.pending)

    def idle_piece(self) -> bool:
        """One piece of the re-tune, once the engine has been idle idle_after seconds (till
        then a short sleep). Returns whether there is more to do."""
        if self.pending is None:
            return False
        wait = self.last_busy + self.idle_after - self.clock()
        if wait > 0:
            self.sleep(min(IDLE_POLL_S, wait))
            return True
        if self._job is None:
            self.attempts += 1
            self._job = self._retune()
        try:
            with unpacked_once():  # never spanning a piece: the engine steps in between
                next(self._job)
            return True
        except StopIteration:
            self._job = None
            return self.pending is not None

    def _retune(self):
        """A generator: the plan's shapes measured again, a piece per next(); the cache
        written if every shape's timings were stable."""
        plan = self.plan
        t0 = time.perf_counter()
        evict = tuning._Evictor(tuning.llc_bytes()) if plan.from_memory else None
        results, unstable = {}, []
        window = tuning._load_window()
        for ps in plan.shapes:
            yield
            src = tuning.synthetic_source(ps, plan.fast)
            stab = tuning.Stability()
            cands = ps.candidates
            results[ps.cache_key] = (yield from tuning.measure_pieces(
                [src] * ps.layers, cands, plan.act, time_it=len(cands) > 1,
                default=ps.default, evict=evict, stability=stab)) + (cands,)
            del src
            unstable += [f"{ps.key}: {r}" for r in stab.reasons]
        # The start-up's cross-shape check (tuning.RATE_SPREAD), every shape fresh here.
        rates = tuning._shape_rates((ps.cache_key, results[ps.cache_key][0], ps.in_features,
                                     ps.out_features) for ps in plan.shapes)
        unstable += [f"{key}: {tuning._rate_reason(ratio)}"
                     for key, ratio in tuning._slow_shapes(rates, set(rates)).items()]
        busy = tuning._busy_reason(window)
        unstable += [f"the table: {busy}"] * bool(busy)
        extra = {}
        for width in sorted({ps.silu_width for ps in plan.shapes if ps.silu_width}):
            yield
            extra[f"{tuning.ACT_KEY}:{width}"] = {"silu_and_mul": tuning._silu_pass_us(width,
                                                                                     plan.act)}
        if plan.norm is not None:
            yield
            extra[tuning.OP_CALL_KEY] = {"rms_norm": [tuning._op_call_us(plan.norm)]}
        if unstable:
            give_up = self.attempts >= MAX_RETUNES
            logger.warning("re-tuning the linear methods while idle: timings unstable again "
                           "(%s)%s", "; ".join(unstable),
                           ", giving up" if give_up else ", trying again when idle")
            if give_up:
                self.pending = None
            else:  # the next attempt after another idle spell
                self.last_busy = self.clock()
            return
        cache = TuningCache(plan.cache_dir, plan.machine)
        for key, (times, failed, invariant, cands) in results.items():
            cache.put(key, times, failed, invariant, cands)
        for key, times in extra.items():
            cache.put(key, times, [], [], [])
        cache.entries.pop(self.step_key, None)  # measured against the old times
        cache.save()
        self.written = True
        self.pending = None
        logger.warning("re-tuned the linear methods while idle (%.1f s): written to %s for "
                       "the next start; this engine keeps serving the table it started on",
                       time.perf_counter() - t0, cache.path)
