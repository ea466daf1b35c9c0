"""Linear methods chosen by measuring the machine at hand, once, at start-up.

`finalize_linears` turns every loaded linear layer into the module the engine runs: for
each distinct layer (weight format, in x out features, bias) and row bucket
(linear_methods.BUCKET_ROWS) it times every method its weight format can run
(linear_methods.WeightFormat.methods), on the layer's own weights, and keeps the fastest
one that passed a known-answer check against the fp32 reference. The table is cached per
machine (CPU model and flags, threads, torch and kernel sources) in the user's cache
directory, so the next start reads it back.

The default method (tiles where they run) is kept unless another is faster by more than
`MARGIN`: timings on a shared machine drift by a few percent, and the tiles (like q8act)
also let a decode step run on the DecodeStack (for a model it runs, its saved calls are
counted: STACK_CALLS). Timing the one-row and few-row buckets sweeps several layers of a
shape (at least `SWEEP_BYTES` of weights, as a decode step streams them from
memory, not from cache); the larger buckets are compute-bound and time one layer.

Rows are also checked bit-identical at every row count (row_invariant), method after
method in the order the batch-invariant choice prefers them until one holds: where such a
method per layer costs at most INVARIANCE_COST more (or where asked), every layer runs it
for all rows, and a request's results no longer depend on its batch. Timing drops a method
from a bucket's later rounds once it is KEEP times the best, and the known-answer check is
each timing's warm-up call.

Timings a busy machine spoiled are not cached: a bucket whose rounds disagree, or a method
timed faster at more rows than at fewer, is timed again (a few times at most); a shape
still unstable makes the table provisional (TuningReport.provisional): served, not
cached, and measured again when the engine is idle (servelm.retune, from the report's
RetunePlan). So is a table measured while other processes took more than BUSY_SHARE of the
CPU time its threads could use (servelm.cpu_load): their jobs can slow one method's every
round alike, which no check of the rounds sees.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from servelm import cpu_load
from servelm.config import INVARIANCE_COST, KernelConfig
from servelm.layers import linear_methods as lm
from servelm.quantization.numerics import unpacked_once
from servelm.tuning_cache import TuningCache, cache_dir, machine_key, times_from

logger = logging.getLogger(__name__)
progress = logging.getLogger("servelm.progress")  # what a user waits for (servelm.cli shows it)

MARGIN = 0.05          # another method must beat the default by 5% to replace it
# A model whose linear weights outgrow the last-level cache streams them from memory every
# decode step, so its one- and 8-row buckets are timed from memory too: before each round of
# those timings a buffer this many times the LLC is read (_Evictor). Without it a sweep
# (SWEEP_BYTES) stays in a large L3 from one round to the next (480 MB on the AMX Xeon) and
# the methods are ranked by their speed from L3 (docs/kernels.md, "Choose the kernels").
EVICT_FACTOR = 1.5
COLD_KEY = ":from-memory"  # the cache's key for a shape timed so
SWEEP_BYTES = 48 << 20  # weights swept per timing of the one-row and few-row buckets
SLICE_BYTES = 4 << 20   # a layer over twice this is timed on a slice of its outputs this big
SLICE_MIN_OUT = 1024    # ... of at least this many outputs (every thread has whole panels)
MIN_REPS, MAX_REPS, TARGET_S = 2, 5, 0.01
EXTRAPOLATE_S = 0.01    # a 64+-row bucket's calls take this long: larger ones are scaled from it
HOPELESS = 8.0          # this many times the best at a bucket: larger buckets are scaled
# ... this many past a bucket over 8 rows: there every method is compute-bound, and a
# method's standing moves less from one such bucket to the next than from the memory-bound
# buckets to the first of them (a per-call cost amortised over more rows closes some of
# a gap, not four-fold of it)
HOPELESS_COMPUTE = 4.0
INVARIANT_WITHIN = 4.0  # row invariance is checked only within this of the best somewhere
# Row counts checked against windows of one INVARIANCE_CALL-row call: on both sides of every
# row blocking a kernel may switch at (oneDNN on AMX switches at several, up to past 128 rows),
# so a kernel that is invariant only for some counts is caught.
INVARIANCE_ROWS = (1, 2, 7, 8, 16, 23, 33, 64, 128, 200)
INVARIANCE_CALL = 320
INVARIANCE_WINDOWS = 8  # windows of m rows checked per row count
INVARIANCE_BYTES = 2 << 20  # ... on a slice of a layer holding over this (an LM head), this big
KEEP = 1.5              # after a timing round, methods slower than this x the best drop out
# ... but after the first round only those this much slower: one busy spell on a shared VM,
# long enough to cover a method's whole first sweep, must not drop the method that is
# fastest the rest of the time (a cached table keeps the choice; docs/kernels.md, "Choose the kernels").
KEEP_FIRST = 3.0
# Stability of the timings (measure): a bucket's rounds disagree where its fastest method's
# median round is over SPREAD times its best and, by median rounds, another method is ahead
# of it (by MARGIN, and JITTER_US µs per call: below that a small layer's timer noise); it
# is timed again up to STABLE_RETRIES times, the rounds pooled. A method timed faster at the
# larger of two buckets timed alike (MONOTONE_PAIRS, under MONOTONE times the smaller's) has
# both timed again once: unless the second timing repeats the first (a kernel's own
# behaviour), what still disagrees makes the table provisional: served, not cached,
# re-measured when the engine is idle (servelm.retune).
SPREAD = 1.25
JITTER_US = 5.0
STABLE_RETRIES = 2
MONOTONE = 0.75
MONOTONE_PAIRS = ((0, 1), (2, 3))  # (1, 8) rows: sweeps; (64, 512): one layer or slice
# The DecodeStack (one C++ call per decode-only step) runs these methods, a stack for each
# run of buckets on them; the tuner counts what it saves in the first STACK_BUCKETS buckets
# (1, 8 and 64 rows, up to 181). Timing layer by layer cannot see that saving: the per-op
# path's calls between the matmuls. (At 64 rows a layer whose stack method and oneDNN tied
# took either by chance, and with it the whole step: on an AMX Xeon the stack ran 64 streams'
# steps ~1.15x faster than the per-op path with equal matmul times.) That is counted as
# STACK_CALLS one-row operator calls per decoder layer, the call's time measured at
# start-up (_op_call_us); the calibration is in docs/kernels.md ("Choose the kernels").
STACK_METHODS = ("tiles", "q8act", "amx", "w8a8")
STACK_BUCKETS = 3
STACK_CALLS = 20
# Across shapes: at the largest bucket a call is compute-bound, so every large shape's best
# method runs at about one rate (operations per second). A freshly measured shape whose best
# rate there is under 1 / RATE_SPREAD of the median over the table's shapes (at least
# RATE_SHAPES of them doing RATE_MIN_OPS operations a call: smaller ones are call overheads)
# was timed in a spell the in-shape checks could not see (every method of that shape slowed
# alike, its rounds steady); it is measured again once, and if still off the table is
# provisional.
RATE_SPREAD = 2.0
RATE_SHAPES = 3
RATE_MIN_OPS = 1e8
# Other processes that took more than this share of the CPU time the tuner's threads could
# use while it measured (servelm.cpu_load) make the table provisional: jobs beside a tuning
# slow a method whose calls run parallel regions in every round alike (each waits for a
# thread the scheduler parked), which the checks of the rounds cannot see (docs/kernels.md,
# "Choose the kernels"; benchmarks/noisy_tuning.py).
BUSY_SHARE = 0.1


def _load_window() -> cpu_load.LoadWindow:
    """A window over the machine's load while the tuner measures (its own threads apart)."""
    return cpu_load.LoadWindow(torch.get_num_threads())


def _busy_reason(window: cpu_load.LoadWindow) -> str | None:
    """Why a window's measurements are not trusted: other processes took over BUSY_SHARE
    of the CPU time the threads could use (None: they did not, or it cannot be told)."""
    share = window.contention()
    if share is None or share <= BUSY_SHARE:
        return None
    return (f"other processes took {share:.0%} of the CPU time its {window.threads} threads "
            "could use while it measured")


@dataclasses.dataclass
class Stability:
    """What measure found unstable in one shape's timings (empty reasons: trusted), and how
    many buckets it timed again to settle them."""

    reasons: list[str] = dataclasses.field(default_factory=list)
    retries: int = 0

    @property
    def unstable(self) -> bool:
        return bool(self.reasons)


@dataclasses.dataclass
class ShapeChoice:
    """The measured methods of one distinct layer shape: per method, µs per call by bucket
    (inf: not timed, or failed its check); the method chosen for each bucket."""

    key: str
    names: list[str]            # the layers of this shape (e.g. 'layers.0.self_attn.qkv_proj')
    methods: list[str]          # one per bucket
    times_us: dict[str, list[float]]
    failed: list[str]
    cached: bool = False
    invariant: list[str] = dataclasses.field(default_factory=list)  # checked row-invariant
    candidates: list[str] = dataclasses.field(default_factory=list)  # checked (and timed)
    # Why its timings are not trusted (measure's Stability.reasons; empty: trusted)
    unstable: list[str] = dataclasses.field(default_factory=list)

    @property
    def quantised(self) -> bool:
        """Whether the layers hold int4 or int8 weights (the key's weight format)."""
        return self.key.startswith("int")

    def row(self) -> str:
        kind = self.names[0].rsplit(".", 1)[-1] if self.names else "?"
        parts = []
        for i, rows in enumerate(lm.BUCKET_ROWS):
            m = self.methods[i]
            t = self.times_us.get(m, [math.inf] * len(lm.BUCKET_ROWS))[i]
            parts.append(f"{rows}: {m}" + (f" {t:.0f}us" if math.isfinite(t) else ""))
        return f"{kind:<14} {self.key:<28} x{len(self.names):<3} " + " | ".join(parts)


@dataclasses.dataclass
class TuningReport:
    """What finalize_linears decided, shape by shape, and how long measuring took."""

    shapes: list[ShapeChoice]
    seconds: float = 0.0
    source: str = "off"  # off | cached | measured | forced
    cache_path: str | None = None
    # Whether every layer runs one row-invariant method (None: not checked, as with tuning
    # off or a forced method), and what that costs against the fastest choice per bucket.
    batch_invariant: bool | None = None
    invariance_cost: list[float] = dataclasses.field(default_factory=list)
    # The one- and 8-row buckets timed from memory: the weights outgrow the LLC (EVICT_FACTOR).
    from_memory: bool = False
    # Quantised shapes that may not hold a dequantised copy (over the copies' memory budget).
    copies_dropped: list[str] = dataclasses.field(default_factory=list)
    # Some shape's timings stayed unstable (ShapeChoice.unstable), or the machine was busy
    # (busy: why): the table is served but not cached, and re-measured when the engine is
    # idle (servelm.retune).
    provisional: bool = False
    busy: str | None = None
    # What an idle re-tune needs to measure this table's shapes again (servelm.retune;
    # None where nothing was tuned: tuning off, a forced method, not the CPU).
    plan: "RetunePlan | None" = None

    def table(self) -> str:
        inv = {None: "not checked", True: "yes", False: "no"}[self.batch_invariant]
        if self.invariance_cost:
            inv += ", invariant methods cost " + " | ".join(
                f"{r}: {c:.2f}x" for r, c in zip(lm.BUCKET_ROWS, self.invariance_cost))
        unstable = sum(1 for s in self.shapes if s.unstable)
        why = f"{unstable} shapes timed unstably" if unstable else ""
        if self.busy:
            why += (", " if why else "") + self.busy
        head = (f"linear methods ({self.source}, {self.seconds:.2f} s"
                + (f"; PROVISIONAL: {why}, not cached, re-tuned when idle"
                   if self.provisional else "")
                + (f", cache {self.cache_path}" if self.cache_path else "")
                + ("; 1 and 8 rows timed from memory" if self.from_memory else "")
                + (f"; {len(self.copies_dropped)} shapes without dequantised copies (budget)"
                   if self.copies_dropped else "")
                + f"; batch-invariant: {inv})")
        rows = []
        for s in self.shapes:
            rows.append("  " + s.row())
            rows += ["      unstable: " + r for r in s.unstable]
        return "\n".join([head] + rows)


# ---------------------------------------------------------------- choosing

def choose(times_us: dict[str, list[float]], default: str, batch_invariant: bool = False,
           margin: float = MARGIN, invariant: list[str] | None = None) -> list[str]:
    """One method per bucket from measured times (inf: failed or not applicable): the
    fastest, unless the default is within `margin` of it. batch_invariant: one method for
    every bucket, the one whose worst bucket is least behind that bucket's fastest (a sum of
    times would let the prompt-sized bucket's milliseconds outvote a decode row's
    microseconds), the default within the margin, among the `invariant` methods when given."""
    n = len(lm.BUCKET_ROWS)
    ok = {m: t for m, t in times_us.items() if all(math.isfinite(x) for x in t)
          and (invariant is None or m in invariant)}
    if batch_invariant:
        if not ok:
            return [default] * n
        fastest = [min(t[i] for t in times_us.values() if math.isfinite(t[i])) for i in range(n)]

        def worst(m: str) -> float:
            return max(ok[m][i] / max(fastest[i], 1e-9) for i in range(n))
        best = min(ok, key=worst)
        if default in ok and worst(default) <= worst(best) * (1 + margin):
            best = default
        return [best] * n
    out = []
    for i in range(n):
        cands = {m: t[i] for m, t in times_us.items() if math.isfinite(t[i])}
        if not cands:
            out.append(default)
            continue
        best = min(cands, key=cands.get)
        if default in cands and cands[default] <= cands[best] * (1 + margin):
            best = default
        out.append(best)
    return out


def reference_output(ref_weight: torch.Tensor, bias: torch.Tensor | None,
                     x: torch.Tensor) -> torch.Tensor:
    """x @ ref_weight.T (+ bias) in fp32: what every method's output is checked against."""
    want = x.float() @ ref_weight.T
    return want + bias.float() if bias is not None else want


def known_answer(module: nn.Module, ref_weight: torch.Tensor, bias: torch.Tensor | None,
                 x: torch.Tensor, want: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None) -> bool:
    """Whether module(x) is x @ ref_weight.T (+ bias) within the rounding of the dtype it
    computes in (its compute_dtype, else the activations'; fp32: 1e-3 of the output's
    magnitude; bf16/fp16: 3e-2; a module's own check_tolerance where it has one) and
    finite. want: that reference, when already computed
    (every method of a shape is checked against the same one). rows: compare only these
    rows of the output (want then holds just them)."""
    return _checked_call(module, ref_weight, bias, x, want, rows)[0]


def _checked_call(module: nn.Module, ref_weight: torch.Tensor, bias: torch.Tensor | None,
                  x: torch.Tensor, want: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> tuple[bool, float]:
    """known_answer, and the seconds the call of module(x) took (inf if it raised)."""
    try:
        y, seconds = _timed_call(module, x)
    except Exception as e:  # a kernel that cannot take this shape is simply not used
        logger.info("linear method %s failed: %s", type(module).__name__, e)
        return False, math.inf
    y = y.float() if rows is None else y[rows].float()
    if want is None:
        want = reference_output(ref_weight, bias, x if rows is None else x[rows])
    if y.shape != want.shape or not torch.isfinite(y).all():
        return False, seconds
    tol = getattr(module, "check_tolerance", None) or (
        1e-3 if getattr(module, "compute_dtype", x.dtype) == torch.float32 else 3e-2)
    return (y - want).abs().max().item() <= tol * max(want.abs().max().item(), 1e-6), seconds


def check_input(src: nn.Module, rows: int, g: torch.Generator, act: torch.dtype) -> torch.Tensor:
    """Random activations [rows, in_features] a method of src is timed and checked on:
    normal, each channel scaled by its calibrated range where the layer has one (the w8a8
    method smooths by it: on inputs of equal channels, the channels it shrinks would hold
    the row's range and those it widens lose their bits, an error no real input shows)."""
    x = torch.randn(rows, src.in_features, generator=g)
    profile = lm.w8a8.calibrated(src)  # (on the layer's device: CUDA's calibrations are)
    return (x if profile is None else x * profile.float().cpu()).to(act)


def _check_rows(n: int) -> torch.Tensor | None:
    """The rows of an n-row output that a known-answer check compares: all of a few, else
    the first 16 (every position of the kernels' row blocks of 2, 4, 6, 8 and 16), every
    fifth (5 is prime to those blocks, so later blocks are sampled at every position too)
    and the last 7 (the tail block): the reference for a 512-row bucket then costs a
    quarter of the call it checks."""
    if n <= 32:
        return None
    return torch.tensor(sorted(set(range(16)) | set(range(0, n, 5)) | set(range(n - 7, n))))


def row_invariant(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether module's rows are bit-identical whatever the row count: for each m of
    INVARIANCE_ROWS below x's rows (x: INVARIANCE_CALL rows), module on up to
    INVARIANCE_WINDOWS disjoint windows of m rows of x equals those rows of module(x). A
    kernel that switches algorithm or splits the reduction by row count fails it. In bf16
    the output's rounding hides most of the fp32 sums such a switch changes, so one window
    may miss it (docs/kernels.md, "Choose the kernels"): the windows look at up to 8x as many rows."""
    try:
        full = module(x)
        n = x.shape[0]
        for m in INVARIANCE_ROWS:
            for s in range(0, n - m + 1, m)[:INVARIANCE_WINDOWS]:
                if not torch.equal(module(x[s:s + m].clone()), full[s:s + m]):
                    return False
        return True
    except Exception:
        return False


def _timed_call(mod: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """mod(x), and the seconds it took: every timing of the tuner goes through here."""
    t0 = time.perf_counter()
    y = mod(x)
    return y, time.perf_counter() - t0


def _time_sweep(mods: list[nn.Module], x: torch.Tensor) -> float:
    """Seconds per call of one sweep over `mods` (one call each)."""
    return sum(_timed_call(m, x)[1] for m in mods) / len(mods)


class _Timings(dict):
    """_time_interleaved's result: seconds per call by method (the best round), and in
    `samples` every round's, by method (what the stability check reads: _unstable_rounds)."""

    samples: dict[str, list[float]]


def _time_interleaved(sweeps: dict[str, list[nn.Module]], x: torch.Tensor,
                      first: dict[str, float] | None = None,
                      evict=None) -> dict[str, float]:
    """Seconds per call of each method's sweep: the best of a few rounds, each round timing
    every method still in the running once in turn, so a machine whose load drifts (other
    processes, frequency) weighs on every method alike rather than on whichever was timed
    during a busy spell. After each round only the methods within KEEP of the best go on
    (KEEP_FIRST after the first, so one busy spell drops nothing): one already 1.5x as slow
    is not chosen whatever its next rounds say, and a large layer's slow method can cost a
    tenth of a second a call. The caller has just run each sweep's first module on x (its
    known-answer check), which warmed it up; first: the seconds those calls took (one
    module a sweep), a sample for the best but no round: taken as the first round, they
    dropped oneDNN at 64 rows, whose first call of a shape compiles its kernel. evict: called
    (untimed) before each round, so every method's sweep in it reads its weights from memory
    (each sweep's weights are read once a round). Returns a _Timings (with each round's
    seconds in its samples)."""
    best = {k: math.inf for k in sweeps}
    samples: dict[str, list[float]] = {}
    active = list(sweeps)
    rounds, spent = 0, 0.0
    if first:  # a sample, not a round: a first call may be cold (oneDNN compiles a kernel
        best.update({k: first[k] for k in sweeps})  # for each new shape: 8-15x at 64 rows)
        spent = sum(best.values())
    # The time budget stays that of every method: the close contenders left get the rounds
    # the dropped ones no longer take, and their best is the less noisy for it.
    while active and rounds < MAX_REPS and (rounds < MIN_REPS
                                            or spent < TARGET_S * len(sweeps)):
        if evict is not None:
            evict()
        for k in active:
            mods = sweeps[k]
            t = _time_sweep(mods, x)
            best[k] = min(best[k], t)
            samples.setdefault(k, []).append(t)
            spent += t * len(mods)
        rounds += 1
        lo = min(best.values())
        keep = KEEP_FIRST if rounds == 1 else KEEP
        active = [k for k in active if best[k] <= keep * lo]
        if len(active) < 2 and rounds >= MIN_REPS:  # the one left is chosen anyway
            break
    out = _Timings(best)
    out.samples = samples
    return out


def measure(srcs: list[nn.Module], methods: list[str], act: torch.dtype, seed: int = 0,
            time_it: bool = True, default: str | None = None, evict=None,
            stability: "Stability | None" = None
            ) -> tuple[dict[str, list[float]], list[str], list[str]]:
    """measure_pieces run to its end: the shape measured in one go."""
    pieces = measure_pieces(srcs, methods, act, seed, time_it, default, evict, stability)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def measure_pieces(srcs: list[nn.Module], methods: list[str], act: torch.dtype, seed: int = 0,
                   time_it: bool = True, default: str | None = None, evict=None,
                   stability: "Stability | None" = None):
    """A generator: measure's work, yielding between its pieces (building the methods, each
    bucket's timing, the invariance check), so an idle engine can run it a piece at a time
    (servelm.retune); its return value (StopIteration.value) is measure's.

    Time each method over layers of one shape (srcs) at every bucket's row count (unless
    not time_it: one method, nothing to compare), the methods interleaved round by round.
    Returns µs per call by method and bucket, the methods that failed their known-answer
    check, and the row-invariant method (row_invariant) that choose(batch_invariant=True)
    takes, as a list of one (or none).

    A bucket past one of over 8 rows whose calls already take EXTRAPOLATE_S is compute-bound
    for every method: its time is the previous bucket's scaled by the rows, not measured (an
    LM head at 512 rows would take most of a second a call on a small CPU). One and 8 rows
    are memory-bound: a long one-row call (a 1.5B model's LM head, 10 ms) says nothing of
    the 8-row one, which is measured. So is a bucket past one where the method took
    HOPELESS times the best method's time (PyTorch's int8pack with fp32 activations on an
    AVX2 CPU: 10-40x qdot's), HOPELESS_COMPUTE past one over 8 rows. A layer too large to
    time whole at those buckets (_slice_outputs: an LM head) is timed and checked there on
    a slice of its outputs, the times scaled to the whole layer (at one and 8 rows, a layer
    over twice SWEEP_BYTES on a slice of SWEEP_BYTES); finalize_linears checks the chosen
    methods on the whole layer. evict (see _time_interleaved): the one- and 8-row buckets
    timed from memory.

    Stability (recorded in `stability`): a bucket whose choice rests on rounds that
    disagree (_unstable_rounds) is timed again, up to STABLE_RETRIES times, the rounds
    pooled; a method timed clearly faster at 8 rows than at one, or at 512 than at 64
    (_non_monotone: the pairs timed alike), has both buckets timed again once (the same
    times again: the kernel's own behaviour, trusted). What still disagrees after that is
    written to stability.reasons: the shape's times are not to be trusted (finalize_linears
    then serves the table but does not cache it).

    Row invariance (row_invariant: a call of INVARIANCE_CALL rows, then windows of it, on
    a slice of at most INVARIANCE_BYTES of the layer's outputs) is checked lazily, in the order
    choose(batch_invariant=True, default=default) prefers the methods, until one holds: the
    methods it would prefer to that one are known not to be invariant, and those after it
    are never chosen for invariance, so checking them would change nothing. Only methods
    within INVARIANT_WITHIN of the best in some bucket are candidates: one slower than that
    everywhere is never chosen (batch_invariant None takes one within INVARIANCE_COST; True
    then reports no invariant method for the shape rather than running 4x slower)."""
    src0 = srcs[0]
    sweep = srcs[:max(1, min(len(srcs), -(-SWEEP_BYTES // _bytes(src0))))]
    # A layer over twice SWEEP_BYTES (a 1.5B model's LM head: 140 MB in int4) is a sweep
    # on its own: timed at one and 8 rows on a slice of SWEEP_BYTES, which streams from
    # memory as the whole does, at the cost of building a third of it per method.
    sweep_keep = _slice_outputs(src0, SWEEP_BYTES, 2 * SWEEP_BYTES)
    if sweep_keep < src0.out_features:
        sweep = [lm.head(src0, sweep_keep)]
    keep = _slice_outputs(src0)
    part = lm.head(src0, keep) if keep < src0.out_features else None
    scale = src0.out_features / keep  # slice times -> the whole layer's
    inv_keep = _slice_outputs(src0, INVARIANCE_BYTES, INVARIANCE_BYTES)
    inv_part = lm.head(src0, inv_keep) if inv_keep < src0.out_features else None
    ref_w, bias = lm.reference_weight(src0), src0.bias
    g = torch.Generator().manual_seed(seed)
    xs = [check_input(src0, rows, g, act) for rows in lm.BUCKET_ROWS]
    x_inv = check_input(src0, INVARIANCE_CALL, g, act)
    n = len(lm.BUCKET_ROWS)
    times: dict[str, list[float]] = {}
    failed = []
    built: dict[str, list[nn.Module]] = {}  # the sweep (the first: the layer itself)
    large: dict[str, nn.Module] = {}  # what times the buckets over 8 rows: the layer or slice
    inputs = [x_inv[:8]] + xs
    wants: dict[int, torch.Tensor] = {}  # index in inputs -> its reference, once per shape
    call_s: dict[str, float] = {}  # each method's checked call at this bucket, in seconds

    def checked(method: str, mod: nn.Module, i: int, outputs: int) -> bool:
        sel = _check_rows(inputs[i].shape[0])
        w, b = ref_w, bias
        if outputs < src0.out_features:  # a slice: its first outputs
            w, b = ref_w[:outputs], None if bias is None else bias[:outputs]
        if i not in wants:
            x = inputs[i] if sel is None else inputs[i][sel]
            wants[i] = reference_output(w, b, x)
        ok, call_s[method] = _checked_call(mod, w, b, inputs[i], wants[i], sel)
        return ok

    def big(method: str) -> nn.Module:  # built when first needed
        if method not in large:
            large[method] = built[method][0] if part is None else lm.build(method, part, act)
        return large[method]

    def inv_module(method: str) -> nn.Module:  # what row_invariant checks
        return built[method][0] if inv_part is None else lm.build(method, inv_part, act)

    for method in methods:
        yield
        mods = _sweep_modules(method, sweep if time_it else sweep[:1], act)
        # (Timed, a method is checked at each bucket, its first call there.)
        if not time_it and not checked(method, mods[0], 0, sweep_keep):
            failed.append(method)
            times[method] = [math.inf] * n
            continue
        built[method] = mods
        times[method] = []
    if not time_it:
        invariant = [m for m in built if row_invariant(inv_module(m), x_inv)]
        return {m: t for m, t in times.items() if t}, failed, invariant
    best: list[float] = []
    timed_at: list[dict[str, list[nn.Module]]] = []  # per bucket: the sweeps timed there
    samples_at: list[dict[str, list[float]]] = []   # ... and each round's seconds per call
    per_at: list[float] = []                        # ... and their scale to the whole layer
    retries = 0

    def retime(i: int, which: list[str]) -> dict[str, float]:
        """Bucket i timed again for `which` (methods timed there), its rounds pooled; the
        new timing's own µs by method."""
        nonlocal retries
        retries += 1
        rows = lm.BUCKET_ROWS[i]
        sub = {m: timed_at[i][m] for m in which}
        again = _time_interleaved(sub, xs[i], None, evict if rows <= 8 else None)
        _pool(samples_at[i], again)
        for m, sec in again.items():
            times[m][i] = min(times[m][i], sec * per_at[i] * 1e6)
            for j in range(i + 1, n):  # a larger bucket scaled from this one follows it
                if j >= len(timed_at) or m in timed_at[j] or len(times[m]) <= j:
                    break
                times[m][j] = times[m][j - 1] * lm.BUCKET_ROWS[j] / lm.BUCKET_ROWS[j - 1]
        return {m: sec * per_at[i] * 1e6 for m, sec in again.items()}

    def noisy(i: int) -> dict[str, float]:
        """_unstable_rounds at bucket i."""
        return _unstable_rounds({m: times[m][i] for m in timed_at[i]}, samples_at[i],
                                per_at[i] * 1e6)

    def settle(i: int) -> None:
        """A method whose rounds at bucket i still disagree while one ahead of it by medians
        has steady rounds: the noise is this method's own (a busy machine slows every
        method's rounds), so it counts at its median round and the medians choose (amx's
        8-row calls on the Xeon swing 1.3-1.7x, beside q8act's steady ones)."""
        for m in noisy(i):
            med = {o: _median(ts) * per_at[i] * 1e6 for o, ts in samples_at[i].items()
                   if len(ts) >= 2 and o in timed_at[i] and len(times[o]) > i}
            if any(o != m and v * (1 + MARGIN) < med.get(m, 0.0)
                   and v <= SPREAD * times[o][i] for o, v in med.items()):
                times[m][i] = med[m]

    for i, (rows, x) in enumerate(zip(lm.BUCKET_ROWS, xs)):
        yield
        timed: dict[str, list[nn.Module]] = {}
        for method, mods in built.items():
            t = times[method]
            if len(t) > i:  # failed at an earlier bucket
                continue
            if t:
                prev = lm.BUCKET_ROWS[i - 1]
                compute_bound = prev > 8 and t[-1] > EXTRAPOLATE_S * 1e6
                hopeless = HOPELESS_COMPUTE if prev > 8 else HOPELESS
                if compute_bound or t[-1] > hopeless * best[i - 1]:
                    t.append(t[-1] * rows / prev)
                    continue
            mod = big(method) if rows > 8 else mods[0]
            if not checked(method, mod, i + 1, keep if rows > 8 else sweep_keep):  # a warm-up
                failed.append(method)
                times[method] = [math.inf] * n
            else:
                timed[method] = mods if rows <= 8 else [mod]
        # A prompt-sized call is long enough to time on its own: the checked call is one
        # more sample (a cold first call only loses to the rounds' best).
        first = {m: call_s[m] for m in timed} if rows > 8 else None
        per = scale if rows > 8 else src0.out_features / sweep_keep
        timed_at.append(timed)
        samples_at.append({})
        per_at.append(per)
        got = _time_interleaved(timed, x, first, evict if rows <= 8 else None)
        _pool(samples_at[i], got)
        for method, sec in got.items():
            times[method].append(sec * per * 1e6)
        for _ in range(STABLE_RETRIES):
            if not noisy(i):
                break
            yield
            retime(i, [m for m in timed if m in samples_at[i]])
        settle(i)
        best.append(min((t[i] for t in times.values() if len(t) > i), default=math.inf))
    pairs = _non_monotone(times, [set(t) for t in timed_at])
    first_us = {(m, b): times[m][b] for m, i, j in pairs for b in (i, j)}
    again_us: dict[tuple[str, int], float] = {}
    for i, j in sorted({(i, j) for _, i, j in pairs}):
        for b in (i, j):
            yield
            again_us.update({(m, b): us for m, us in retime(b, list(timed_at[b])).items()})
            settle(b)  # the new rounds pooled: a method's own noise counts at its median again

    def reproduced(m: str, i: int, j: int) -> bool:
        """Whether timing buckets i and j again gave method m the times it had (within
        SPREAD): a kernel that is faster at more rows (amx at 8 rows against one: its
        one-row call pads a whole tile) rather than a spell that came and went."""
        for b in (i, j):
            a, c = first_us.get((m, b), math.inf), again_us.get((m, b), math.inf)
            if not max(a, c) <= SPREAD * min(a, c):
                return False
        return True
    if stability is not None:
        stability.retries += retries
        for b in range(n):
            for m, spread in noisy(b).items():
                stability.reasons.append(f"{m} at {lm.BUCKET_ROWS[b]} rows: its rounds "
                                         f"disagree (median {spread:.2f}x its best; by "
                                         "medians another method is ahead)")
        for m, i, j in _non_monotone(times, [set(t) for t in timed_at]):
            if reproduced(m, i, j):
                continue
            stability.reasons.append(f"{m} timed faster at {lm.BUCKET_ROWS[j]} rows than at "
                                     f"{lm.BUCKET_ROWS[i]} ({times[m][j]:.0f} against "
                                     f"{times[m][i]:.0f} us)")
    remaining = [m for m in built if m not in failed
                 and any(times[m][i] <= INVARIANT_WITHIN * best[i] for i in range(n))]
    while remaining:
        yield
        pick = choose(lm.eligible(times), default or remaining[0], True, invariant=remaining)[0]
        if pick not in remaining:
            break
        if row_invariant(inv_module(pick), x_inv):
            return times, failed, [pick]
        remaining.remove(pick)
    return times, failed, []


def _pool(samples: dict[str, list[float]], got: dict[str, float]) -> None:
    """A timing's rounds (_Timings.samples) added to a bucket's."""
    for m, ts in getattr(got, "samples", {}).items():
        samples.setdefault(m, []).extend(ts)


def _median(ts: list[float]) -> float:
    """A method's typical round: of two, the slower; of an even number past two, the lower
    middle one (a re-timing's quiet rounds outvote a spell's as soon as they are half)."""
    return max(ts) if len(ts) == 2 else sorted(ts)[(len(ts) - 1) // 2]


def _unstable_rounds(best_us: dict[str, float], samples: dict[str, list[float]],
                     us_per_s: float) -> dict[str, float]:
    """Whether one bucket's choice rests on rounds that disagree: {the fastest method (by
    best_us, µs per call): its median round over its best} where that ratio is over SPREAD
    and, ranked by their median rounds instead, another method is ahead of it by over
    MARGIN (and JITTER_US µs per call; us_per_s turns a sample into the whole layer's µs);
    else {}. A method's noisy rounds that change no choice (far ahead, or far behind) do
    not count: the table is as good either way. A method with one round (dropped after it)
    has no median."""
    meds = {m: _median(ts) * us_per_s for m, ts in samples.items()
            if len(ts) >= 2 and m in best_us}
    if not meds or not best_us:
        return {}
    win = min(best_us, key=best_us.get)
    if win not in meds:
        return {}
    spread = meds[win] / max(best_us[win], 1e-12)
    other = min((v for m, v in meds.items() if m != win), default=math.inf)
    if spread > SPREAD and meds[win] > other * (1 + MARGIN) and meds[win] - other > JITTER_US:
        return {win: spread}
    return {}


def _non_monotone(times: dict[str, list[float]], timed_at: list[set[str]]
                  ) -> list[tuple[str, int, int]]:
    """(method, smaller bucket, larger bucket) where a method was timed clearly faster (under
    MONOTONE times, and by over JITTER_US) at the larger of two buckets timed alike: one and
    8 rows (a sweep, from memory where the weights outgrow the LLC) or 64 and 512 (one layer
    or slice). A call of more rows does at least the work of fewer; such a pair says a busy
    spell weighed on the smaller bucket's rounds. Only methods within KEEP of a bucket's
    best there count: the others are never chosen."""
    out = []
    for i, j in MONOTONE_PAIRS:
        if j >= len(timed_at):
            continue
        fastest = [min((t[b] for t in times.values() if len(t) > b), default=math.inf)
                   for b in (i, j)]
        for m, t in times.items():
            if m not in timed_at[i] or m not in timed_at[j]:
                continue
            if not (t[i] <= KEEP * fastest[0] or t[j] <= KEEP * fastest[1]):
                continue
            if t[j] < MONOTONE * t[i] and t[i] - t[j] > JITTER_US:
                out.append((m, i, j))
    return out


def _slow_shapes(rates: dict[str, float], fresh: set[str]) -> dict[str, float]:
    """{shape key: its rate over the median} for the fresh shapes whose best rate at the
    largest bucket (rates: operations per µs, over the shapes doing RATE_MIN_OPS a call) is
    under 1 / RATE_SPREAD of the median of all; {} with fewer than RATE_SHAPES shapes."""
    if len(rates) < RATE_SHAPES:
        return {}
    med = sorted(rates.values())[(len(rates) - 1) // 2]
    return {k: r / med for k, r in rates.items()
            if k in fresh and r * RATE_SPREAD < med}


def _shape_rates(entries) -> dict[str, float]:
    """{key: operations per µs of the shape's fastest method at the largest bucket} over
    (key, times_us (µs per bucket, by method), in_features, out_features) entries, leaving
    out a call of under RATE_MIN_OPS operations and a shape with nothing timed there."""
    out = {}
    for key, times_us, k, n in entries:
        ops = 2.0 * lm.BUCKET_ROWS[-1] * k * n
        best = min((t[-1] for t in times_us.values() if t and math.isfinite(t[-1])),
                   default=math.inf)
        if ops >= RATE_MIN_OPS and math.isfinite(best) and best > 0:
            out[key] = ops / best
    return out


def _rate_reason(ratio: float) -> str:
    """What a shape _slow_shapes found makes unstable."""
    return f"{lm.BUCKET_ROWS[-1]} rows ran at {ratio:.2f}x the other shapes' rate"


def _sweep_modules(method: str, srcs: list[nn.Module], act: torch.dtype) -> list[nn.Module]:
    """The method's module for srcs[0], and for each further layer of the sweep a copy of
    it: the sweep only needs its bytes spread over fresh memory (timing a step's stream of
    weights, not one layer's warm in the cache), and copying is far cheaper than building
    (int4: unpacking the tiles, dequantising, repacking each layer again per method)."""
    first = lm.build(method, srcs[0], act)
    try:
        return [first] + [_clone(first) for _ in srcs[1:]]
    except Exception:  # a module holding something that does not copy: build each
        return [first] + [lm.build(method, s, act) for s in srcs[1:]]


def _clone(mod: nn.Module) -> nn.Module:
    """A copy of mod whose tensors (parameters, buffers, tensor attributes, its submodules')
    are fresh copies in their own memory, its other state shared: copy.deepcopy's walk
    through every attribute was most of the time the sweeps took to build."""
    new = copy.copy(mod)
    d = new.__dict__
    for k, v in list(d.items()):
        if k in ("_parameters", "_buffers"):
            d[k] = {n: _clone_tensor(t) for n, t in v.items()}
        elif k == "_modules":
            d[k] = {n: None if m is None else _clone(m) for n, m in v.items()}
        elif isinstance(v, torch.Tensor):
            d[k] = _clone_tensor(v)
        elif isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
            d[k] = type(v)(_clone_tensor(t) if isinstance(t, torch.Tensor) else t for t in v)
    return new


def _clone_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    c = t.detach().clone()
    return nn.Parameter(c, requires_grad=False) if isinstance(t, nn.Parameter) else c


def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The last-level cache's size in bytes as the OS reports it for CPU 0 (its largest
    cache of level 3 or more; 0: none reported)."""
    best = 0
    for d in Path(root).glob("index*"):
        try:
            level = int((d / "level").read_text())
            size = (d / "size").read_text().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
            n = int(size[:-1] if size[-1:].isalpha() else size) * unit
        except (OSError, ValueError):
            continue
        if level >= 3:
            best = max(best, n)
    return best


class _Evictor:
    """Reads a buffer EVICT_FACTOR times the LLC each call: what was cached is gone after it
    (allocated on the first call: a start that reads its table back never pays for it)."""

    def __init__(self, llc: int):
        self.nbytes = int(EVICT_FACTOR * llc)
        self.buf: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.buf is None:
            self.buf = torch.ones(self.nbytes, dtype=torch.uint8)
        self.buf.max()


def _tensors(src: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(src.parameters()) + list(src.buffers()) if t is not None]


def _bytes(src: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(src)) or 1


def _slice_outputs(src: nn.Module, target: int | None = None, whole: int | None = None) -> int:
    """How many of the layer's outputs the tuner times at prompt-sized buckets: all of
    them, unless the layer holds over `whole` bytes (default 2 SLICE_BYTES: an LM head, 113
    MB in fp32 for the embedded model, or a 1.5B model's MLP); then a multiple of 32 (the
    amx method's column pair) holding about `target` bytes (default SLICE_BYTES), at least
    SLICE_MIN_OUT. The buckets over 8 rows and the invariance check (INVARIANCE_BYTES for
    both: its 71 calls, mostly of a few rows, each stream the weights they are given) use
    a slice: they are compute-bound, their time grows with the outputs, and timed whole
    they were half of a fresh tuning. One and 8 rows stream the weights from memory, and
    a slice swept in copies ranked the methods by cache luck: they take a slice only of a
    layer over twice SWEEP_BYTES, SWEEP_BYTES of it, swept alone."""
    target = SLICE_BYTES if target is None else target
    whole = 2 * SLICE_BYTES if whole is None else whole
    b = _bytes(src)
    if b <= whole:
        return src.out_features
    n = max(SLICE_MIN_OUT, src.out_features * target // b // 32 * 32)
    return min(n, src.out_features)


# ---------------------------------------------------------------- the swap

def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(qualified name, parent, attribute, source) of every linear layer a method can run."""
    from servelm.quantization.formats import QuantLinear, TiledLinear

    out = []
    for pname, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear or (isinstance(child, QuantLinear)
                                            and not isinstance(child, TiledLinear)):
                out.append((f"{pname}.{name}" if pname else name, parent, name, child))
    return out


def _shape_key(src: nn.Module, act: torch.dtype) -> str:
    """The tuner's key of a layer's shape: its format, activations, size, bias and whether
    it is calibrated (':smooth': the w8a8 method may run it; ':smooth64': in activation
    blocks of at most 64)."""
    act_name = str(act).removeprefix("torch.")
    longest = lm.w8a8.longest_block(src)
    return (f"{lm.weight_format(src)}/{act_name}:{src.in_features}x{src.out_features}"
            + (":bias" if src.bias is not None else "")
            + ("" if lm.w8a8.calibrated(src) is None else
               ":smooth" + ("" if longest == lm.w8a8.BLOCKS[0] else str(longest))))


@torch.no_grad()
def finalize_linears(model: nn.Module, quantization: str | None,
                     kernels: KernelConfig | None = None,
                     calibrate: Callable[[nn.Module], object] | None = None) -> TuningReport:
    """The linear layers as the engine runs them, once the weights are loaded (and sharded):
    quantised when asked (weight-only), then on the CPU each layer swapped for the method
    chosen per row bucket (by kernels.linear_method, else measured or read from the cache),
    the kernels' weights packed into huge pages in the order a step reads them. calibrate:
    called with the model between the two (servelm.engine.calibration: the layers it
    calibrates may then run the w8a8 method)."""
    from servelm.hugepages import pack_weights
    from servelm.quantization.formats import kernels_available
    from servelm.quantization.surgery import quantize_model

    kcfg = kernels or KernelConfig()
    p = next(model.parameters(), None)
    if p is None:
        return TuningReport([])
    act, device = p.dtype, p.device  # activations run in the model dtype
    # cpu_kernels off: the eager reference (plain F.linear; quantised layers dequantise).
    fast = kcfg.cpu_kernels and device.type == "cpu"
    if quantization:
        quantize_model(model, quantization, use_kernels=fast and kernels_available())
    if device.type != "cpu":  # CUDA keeps its layers' own kernels (cuBLAS, tinygemm; the
        return TuningReport([])  # int8 activations where faster: servelm.tuning_cuda, after)
    t0 = time.perf_counter()
    if calibrate is not None and fast:
        calibrate(model)
    groups: dict[str, list[tuple[str, nn.Module, str, nn.Module]]] = {}
    for item in _linear_layers(model):
        groups.setdefault(_shape_key(item[3], act), []).append(item)

    forced = kcfg.linear_method != "auto"
    tune = not forced and kcfg.tuning != "off" and fast
    cache = (TuningCache(cache_dir(kcfg.tuning_cache_dir), machine_key(torch.get_num_threads()))
             if tune else None)
    # Weights beyond the LLC come from memory every decode step: so do their timings.
    llc = llc_bytes() if tune else 0
    evict = (_Evictor(llc) if llc and sum(_bytes(it[3]) for items in groups.values()
                                          for it in items) > llc else None)
    cache_keys = {k: k + COLD_KEY if evict else k for k in groups}
    shapes: list[ShapeChoice] = []
    fresh: dict[str, object] = {}  # shape key -> measuring it again (this start's timings)
    measured = False
    todo = ([k for k in groups if kcfg.tuning == "fresh" or cache.get(cache_keys[k]) is None]
            if tune else [])
    if todo:
        progress.info("measuring the matmul methods for %d of %d layer shapes on this machine "
                      "(each %s): once, then cached in %s", len(todo), len(groups),
                      "from memory" if evict else "timed", cache.path)
    bar = tqdm(total=len(todo), desc="tuning matmuls", unit="shape", file=sys.stderr,
               disable=not todo or None, leave=False)
    window = _load_window() if todo else None
    for key, items in groups.items():
        src = items[0][3]
        default = lm.default_method(src, act, fast, auto=not forced)
        fmt = lm.WeightFormat.of(src)
        applicable = fmt.methods(src, act, fast)
        if not forced:
            applicable = [m for m in applicable if lm.tunable(m, act)]
        shape = ShapeChoice(key, [it[0] for it in items], [default] * len(lm.BUCKET_ROWS),
                            {}, [])
        if forced:
            m = next((m for m in kcfg.linear_method.split(",") if m in applicable), default)
            shape.methods = [m] * len(lm.BUCKET_ROWS)
        elif tune:
            # Dequantise + matmul every call (a quantised layer's reference) is never
            # the fastest; one candidate left is checked but needs no timing.
            cands = [m for m in applicable if m != "torch" or not fmt.quantised]
            entry = None if kcfg.tuning == "fresh" else cache.get(cache_keys[key])
            if entry is not None and not set(cands) <= set(entry.get("candidates", [])):
                entry = None  # a method that runs here now was not measured: measure again
            def timed_now(items=items, cands=cands, default=default, key=key):
                stab = Stability()
                with unpacked_once():  # each method's layout from one unpacking
                    times, failed, invariant = measure([it[3] for it in items], cands, act,
                                                       time_it=len(cands) > 1, default=default,
                                                       evict=evict, stability=stab)
                cache.put(cache_keys[key], times, failed, invariant, cands)
                return stab.reasons

            if entry is None:
                shape.unstable = timed_now()
                entry = cache.get(cache_keys[key])
                measured = True
                fresh[key] = timed_now
                bar.update(1)
            else:
                shape.cached = True
            shape.times_us = lm.eligible({m: t for m, t in times_from(entry).items()
                                          if m in applicable})
            shape.failed = entry.get("failed", [])
            shape.invariant = [m for m in entry.get("invariant", []) if m in applicable]
            shape.candidates = [m for m in entry.get("candidates", []) if m in applicable]
            if "amx" in shape.times_us and _swiglu_gate_ups(items):
                # amx writes silu(gate) * up itself (GatedMLP.fuse_activation); every other
                # method leaves the MLP a separate pass over its output: counted in its time.
                act_key = f"{ACT_KEY}:{src.out_features}"
                act_entry = None if kcfg.tuning == "fresh" else cache.get(act_key)
                if act_entry is None:
                    cache.put(act_key, {"silu_and_mul": _silu_pass_us(src.out_features, act)},
                              [], [], [])
                    act_entry, measured = cache.get(act_key), True
                pass_us = times_from(act_entry)["silu_and_mul"]
                shape.times_us = {m: t if m == "amx" else [a + b for a, b in zip(t, pass_us)]
                                  for m, t in shape.times_us.items()}
        shapes.append(shape)
    bar.close()
    if fresh:
        _retime_slow_shapes(shapes, groups, fresh, cache, cache_keys)
    busy = _busy_reason(window) if window is not None and fresh else None
    report = TuningReport(shapes, source=("forced" if forced else "off" if not tune
                                          else "measured" if measured else "cached"),
                          cache_path=str(cache.path) if cache else None,
                          from_memory=evict is not None,
                          provisional=bool(busy) or any(s.unstable for s in shapes), busy=busy)
    if tune:
        stack = None
        on_stack = _stack_layers(model, act, kcfg)
        if on_stack:
            keys = {k for k, items in groups.items() if any(id(it[3]) in on_stack for it in items)}
            entry = None if kcfg.tuning == "fresh" else cache.get(OP_CALL_KEY)
            if entry is None:
                cache.put(OP_CALL_KEY, {"rms_norm": [_op_call_us(model.norm)]}, [], [], [])
                entry, measured = cache.get(OP_CALL_KEY), True
            per_layer = STACK_CALLS * times_from(entry)["rms_norm"][0]
            stack = StackCost(keys, len(model.layers), per_layer)
        budget = (kcfg.dequantized_copy_bytes if kcfg.dequantized_copy_bytes is not None
                  else available_memory() // 4)
        report.copies_dropped = _limit_dequantised_copies(shapes, groups, act, budget)
        _decide(shapes, kcfg.batch_invariant, report, stack)
        report.plan = RetunePlan.of(groups, shapes, cache, cache_keys, act, fast,
                                    evict is not None, model.norm if stack else None)
    for shape in shapes:
        for j, (qname, parent, name, src) in enumerate(groups[shape.key]):
            mod = _swap(src, shape.methods, act)
            if tune and j == 0 and _slice_outputs(src) < src.out_features:
                # Timed and checked on a slice: the methods are checked on the whole layer
                # too, once (the cache keeps the methods that passed; a 1.5B model's LM
                # head took a second to check at every start).
                entry = cache.get(cache_keys[shape.key])
                passed = entry.setdefault("whole_ok", [])
                if not set(shape.methods) <= set(passed):
                    if _whole_layer_ok(mod, src, act):
                        entry["whole_ok"] = sorted(set(passed) | set(shape.methods))
                        measured = True  # (the cache is written)
                    else:
                        logger.warning("linear layer %s: %s failed its known-answer check on "
                                       "the whole layer; running the reference", qname,
                                       shape.methods)
                        shape.failed = sorted(set(shape.failed) | set(shape.methods))
                        shape.methods = ["torch"] * len(lm.BUCKET_ROWS)
                        mod = _swap(src, shape.methods, act)
            setattr(parent, name, mod)
    if measured and not report.provisional:
        cache.save()
    elif report.provisional:
        logger.warning("the linear methods' timings stayed unstable (the machine is busy?): "
                       "serving this table without caching it, to be measured again when "
                       "the engine is idle:\n  %s",
                       "\n  ".join([f"the table: {busy}"] * bool(busy)
                                   + [f"{s.key}: {r}" for s in shapes for r in s.unstable]))
    if fast:  # SwiGLU gate_up layers on amx: SiLU in the matmul's epilogue
        for m in model.modules():
            if hasattr(m, "fuse_activation"):
                m.fuse_activation()
    pack_weights(model, huge=kcfg.hugepages)
    report.seconds = time.perf_counter() - t0
    if todo:
        progress.info("matmul methods measured in %.0f s (%s)", report.seconds,
                      "PROVISIONAL: timings unstable, not cached; measured again when idle"
                      if report.provisional else "cached for the next start")
    logger.info("%s", report.table())
    return report


def _retime_slow_shapes(shapes: list[ShapeChoice], groups: dict, fresh: dict, cache,
                        cache_keys: dict[str, str]) -> None:
    """The cross-shape check (RATE_SPREAD): fresh shapes far under the table's rate at the
    largest bucket measured again once (fresh[key]() times and caches them), their times
    replaced; one still under it is unstable (the table provisional)."""
    by_key = {s.key: s for s in shapes}

    def rates() -> dict[str, float]:
        return _shape_rates((s.key, s.times_us, groups[s.key][0][3].in_features,
                             groups[s.key][0][3].out_features) for s in shapes)

    slow = _slow_shapes(rates(), set(fresh))
    for key in slow:
        s = by_key[key]
        before = times_from(cache.get(cache_keys[key]))
        s.unstable = fresh[key]()
        entry = cache.get(cache_keys[key])
        after = times_from(entry)
        # What the loop added to the measured times (a SiLU pass amx fuses) stays added.
        s.times_us = lm.eligible({
            m: [n + (a - o if math.isfinite(a) and math.isfinite(o) else 0.0)
                for n, a, o in zip(after[m], t, before[m])]
            for m, t in s.times_us.items() if m in after and m in before})
        s.failed = entry.get("failed", [])
        s.invariant = [m for m in entry.get("invariant", []) if m in s.times_us]
    for key, ratio in _slow_shapes(rates(), set(slow)).items():
        by_key[key].unstable = by_key[key].unstable + [_rate_reason(ratio) + ", twice"]


@dataclasses.dataclass
class PlannedShape:
    """One distinct layer shape as an idle re-tune measures it again: on a fresh layer of
    the same format and size (synthetic_source), the live one having been swapped."""

    key: str                # the shape key (_shape_key)
    cache_key: str          # its key in the cache (COLD_KEY appended when timed from memory)
    fmt: str                # lm.weight_format: 'bfloat16', 'float32', 'int8', 'int4g32', ...
    in_features: int
    out_features: int
    bias: bool
    layers: int             # how many layers share it (the sweep spans up to this many)
    candidates: list[str]
    default: str
    silu_width: int = 0     # a SwiGLU gate_up: its SiLU pass's cache entry (ACT_KEY) too


@dataclasses.dataclass
class RetunePlan:
    """What finalize_linears measured, in the form an idle re-tune (servelm.retune) measures
    it again and caches it: the cache's file and key, the activations' dtype, whether the
    small buckets were timed from memory, each shape, and the model's final norm (what the
    per-op call time, OP_CALL_KEY, is timed on; None for a model without the stack)."""

    cache_dir: Path
    machine: dict
    act: torch.dtype
    fast: bool              # the C++ kernels run (KernelConfig.cpu_kernels, on the CPU)
    from_memory: bool
    shapes: list[PlannedShape]
    norm: nn.Module | None = None

    @classmethod
    def of(cls, groups: dict[str, list[tuple[str, nn.Module, str, nn.Module]]],
           shapes: list[ShapeChoice], cache: TuningCache, cache_keys: dict[str, str],
           act: torch.dtype, fast: bool, from_memory: bool, norm: nn.Module | None
           ) -> "RetunePlan":
        planned = []
        for sc in shapes:
            items = groups[sc.key]
            src = items[0][3]
            entry = cache.get(cache_keys[sc.key]) or {}
            planned.append(PlannedShape(
                sc.key, cache_keys[sc.key], lm.weight_format(src), src.in_features,
                src.out_features, src.bias is not None, len(items),
                list(entry.get("candidates", sc.candidates)),
                lm.default_method(src, act, fast, auto=True),
                src.out_features if cache.get(f"{ACT_KEY}:{src.out_features}") is not None
                and _swiglu_gate_ups(items) else 0))
        return cls(cache.path.parent, cache.key, act, fast, from_memory, planned, norm)


def synthetic_source(shape: PlannedShape, fast: bool) -> nn.Module:
    """A fresh layer of the shape's format and size with random weights: what an idle
    re-tune times in place of the model's own layers (swapped for their methods, and a
    method's speed does not depend on the weights' values)."""
    from servelm.quantization.surgery import quantize_linear

    fmt = shape.fmt
    dtype = torch.float32 if fmt.startswith("int") else getattr(torch, fmt)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape.out_features, shape.in_features, generator=g) / shape.in_features ** 0.5
    lin = nn.Linear(shape.in_features, shape.out_features, bias=shape.bias)
    with torch.no_grad():
        lin.weight.copy_(w)
        if shape.bias:
            lin.bias.normal_(generator=g)
    if fmt.startswith("int"):
        from servelm.quantization.formats import kernels_available

        kernels = fast and kernels_available()
        if fmt == "int8":
            out = quantize_linear(lin, "int8", use_kernel=kernels)
        else:
            out = quantize_linear(lin, "int4", int(fmt.removeprefix("int4g")),
                                  use_kernel=kernels)
    else:
        out = lin.to(dtype)
    # A calibrated shape: any calibration times the same (its longest block as the key says).
    if smooth := re.search(r":smooth(\d*)$", shape.key):
        lm.w8a8.set_calibration(out, torch.ones(shape.in_features),
                                int(smooth.group(1) or lm.w8a8.BLOCKS[0]))
    return out


OP_CALL_KEY = "decode/op_call"  # the cache entry of _op_call_us's measurement
ACT_KEY = "mlp/silu_and_mul"  # + ":<gate_up width>": _silu_pass_us's measurement


def _swiglu_gate_ups(items: list[tuple[str, nn.Module, str, nn.Module]]) -> bool:
    """Whether every layer of a shape is a SwiGLU MLP's gate_up_proj (whose SiLU the amx
    method fuses: GatedMLP.fuse_activation)."""
    return all(name == "gate_up_proj" and getattr(parent, "act", None) == "silu"
               and hasattr(parent, "fuse_activation") for _, parent, name, _ in items)


@torch.inference_mode()
def _silu_pass_us(width: int, act: torch.dtype) -> list[float]:
    """µs per bucket of the MLP's separate SiLU-and-mul pass over a gate_up output of
    `width` features (servelm_ops.silu_and_mul), the median of a few calls."""
    from servelm.kernels import load_ops
    from servelm.models.layers import silu_and_mul_ref

    op = torch.ops.servelm_ops.silu_and_mul if load_ops("ops") else silu_and_mul_ref
    return [_median_call_us(op, torch.randn(rows, width).to(act), 7) for rows in lm.BUCKET_ROWS]


def _median_call_us(fn, x: torch.Tensor, calls: int) -> float:
    """µs of fn(x), the median of `calls` calls."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e6


@dataclasses.dataclass
class StackCost:
    """What the DecodeStack changes in _decide: the shapes its layers have, how many decoder
    layers it runs, and what the per-op path costs per layer beyond the matmuls (µs)."""

    keys: set[str]
    layers: int
    per_layer_us: float

    def saved_us(self) -> float:
        return self.layers * self.per_layer_us


def _stack_layers(model: nn.Module, act: torch.dtype, kcfg: KernelConfig) -> set[int] | None:
    """The ids of the linear layers a DecodeStack would run (every decoder layer's qkv, o,
    gate_up and down, and its per-layer input's), when the model is one it implements and it
    can run here (bf16 activations, the C++ kernels, fused_decode on); else None."""
    from servelm.models import decode_stack
    from servelm.models.decoder import CausalLM

    if not (kcfg.fused_decode and kcfg.cpu_kernels and act == torch.bfloat16
            and isinstance(model, CausalLM) and decode_stack.unsupported_reason(model) is None):
        return None
    return {id(m) for layer in model.layers for m in decode_stack.stack_linears(layer)}


@torch.inference_mode()
def _op_call_us(model_norm: nn.Module) -> float:
    """µs of one one-row operator call as the per-op path makes it (the model's final
    RMSNorm, model_norm, on the C++ kernels), the median of 200 calls."""
    norm = copy.deepcopy(model_norm)  # a copy bound to the kernels, the model's own untouched
    x = torch.randn(1, norm.weight.shape[0]).to(norm.weight.dtype)
    norm.select(True)
    return _median_call_us(norm, x, 200)


def _stack_choice(shapes: list[ShapeChoice], free: list[list[str]],
                  stack: StackCost) -> None:
    """Moves the stack's shapes (stack.keys) to the DecodeStack's methods at 1, 8 and 64
    rows, bucket by bucket while that is no slower counting what the stack saves
    (stack.saved_us(), one-row calls: at 64 rows the per-op path's calls cost more, so this
    errs towards the per-op path): at one row each shape's fastest stack method (the default
    within MARGIN; for a quantised shape, not a dequantised method other than the one its
    other buckets hold: _one_dequantised_copy), at 8 and 64 the one-row method (one stack,
    one set of weights, for all three), or a method that cannot run one row (w8a8) where
    the shape holds it for prompts anyway and it is faster there (a stack of its own, no
    further copy of the weights). free is changed in place. (The prompt-sized bucket
    keeps the fastest method.)"""
    idx = [i for i, sc in enumerate(shapes) if sc.key in stack.keys]
    if not idx:
        return
    none = [math.inf] * len(lm.BUCKET_ROWS)  # a method not timed
    for b in range(STACK_BUCKETS):
        alt = {}
        for i in idx:
            sc = shapes[i]
            if b == 0:
                # (not a second dequantised copy of a quantised layer's weights: every
                # bucket past the first keeps its own method where the stack stops early)
                held = {m for m in free[i][1:] if m in lm.DEQUANTISED}
                t = {m: ts for m, ts in sc.times_us.items()
                     if m in STACK_METHODS and math.isfinite(ts[0])
                     and not (sc.quantised and m in lm.DEQUANTISED and held - {m})}
                if not t:
                    return
                alt[i] = choose(t, sc.methods[0])[0]
            else:
                # The one-row method, or one that cannot run one row (w8a8) where the shape
                # holds it for prompts anyway and it is faster here: no further weight copy.
                later = {m for m in (free[i][b], free[i][-1])
                         if lm.by_name(m).first_bucket > 0}
                t = {m: sc.times_us[m] for m in {free[i][0]} | later
                     if m in STACK_METHODS and m in sc.times_us
                     and math.isfinite(sc.times_us[m][b])}
                if free[i][0] not in t:
                    return  # (a stack method timed at one row but failed at 8)
                alt[i] = choose(t, free[i][0])[b]
        t_free = sum(len(shapes[i].names) * shapes[i].times_us.get(free[i][b], none)[b]
                     for i in idx)
        t_stack = sum(len(shapes[i].names) * shapes[i].times_us[alt[i]][b] for i in idx)
        if not t_stack <= t_free + stack.saved_us():
            return
        for i in idx:
            free[i][b] = alt[i]


def available_memory() -> int:
    """Bytes of memory available now (what the auto budget of dequantised copies is a
    share of)."""
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _limit_dequantised_copies(shapes: list[ShapeChoice],
                              groups: dict[str, list[tuple[str, nn.Module, str, nn.Module]]],
                              act: torch.dtype, budget: int) -> list[str]:
    """Keeps the dequantised copies a quantised model's layers may hold (lm.DEQUANTISED:
    amx and onednn hold the weight again in the activation dtype, 3-4x an int4 layer's
    bytes, for faster prompts; w8a8 an int8 copy, counted at the activation dtype's size
    too), and the int8 copies w8a8 adds to an unquantised model's layers, within `budget`
    bytes, at most one per layer (_one_dequantised_copy): while the shapes that could
    choose one would hold more, the largest shape loses those methods. Returns the shapes'
    keys that lost them."""
    size = torch.empty(0, dtype=act).element_size()
    cost = {sc.key: (size if sc.quantised else 1)
            * sum(it[3].in_features * it[3].out_features for it in groups[sc.key])
            for sc in shapes if _copies(sc) & set(sc.times_us)}
    dropped = []
    for key in sorted(cost, key=cost.get, reverse=True):
        if sum(cost[k] for k in cost if k not in dropped) <= budget:
            break
        sc = next(sc for sc in shapes if sc.key == key)
        drop = _copies(sc)
        sc.times_us = {m: t for m, t in sc.times_us.items() if m not in drop}
        sc.invariant = [m for m in sc.invariant if m not in drop]
        sc.candidates = [m for m in sc.candidates if m not in drop]
        dropped.append(key)
    if dropped:
        progress.info("no dequantised or int8 weight copies for %d of %d layer shapes: all "
                      "would take %.2f GB, over the budget of %.2f GB", len(dropped),
                      len(cost), sum(cost.values()) / 1e9, budget / 1e9)
    return dropped


def _copies(sc: ShapeChoice) -> set[str]:
    """The methods that hold a copy of the shape's weights: a quantised shape's dequantised
    ones (lm.DEQUANTISED, w8a8's forms among them), an unquantised shape's w8a8 forms (an
    int8 copy)."""
    return set(lm.DEQUANTISED) if sc.quantised else set(lm.W8A8_FORMS)


def _one_dequantised_copy(sc: ShapeChoice, methods: list[str]) -> list[str]:
    """methods (one per bucket), the shape's buckets holding at most one copy of its weights
    (_copies): where they chose two such methods, the one whose worst bucket among theirs is
    least behind that bucket's choice takes them all (two copies in bf16 hold 8x an int4
    layer's bytes; w8a8 and its tile form would hold the same int8 weights twice)."""
    dense = sorted({m for m in methods if m in _copies(sc)})
    if len(dense) < 2:
        return methods
    buckets = [b for b, m in enumerate(methods) if m in dense]
    none = [math.inf] * len(lm.BUCKET_ROWS)

    def worst(m: str) -> float:
        return max(sc.times_us.get(m, none)[b] / max(sc.times_us[methods[b]][b], 1e-9)
                   for b in buckets)
    keep = min(dense, key=worst)
    return [keep if m in dense else m for m in methods]


def _decide(shapes: list[ShapeChoice], batch_invariant: bool | None,
            report: TuningReport, stack: StackCost | None = None) -> None:
    """Each shape's methods from its measurements: the fastest per bucket (a quantised
    shape's with at most one dequantised copy of its weights: _one_dequantised_copy), or one
    row-invariant method for all (batch_invariant True; None: where every shape has one
    and, summed over the layers, it costs at most INVARIANCE_COST in every bucket). With
    a stack (a model the DecodeStack runs): the stack's methods at 1, 8 and 64 rows where,
    counting the calls it saves, they are no slower (_stack_choice); in the invariance
    cost, whichever of the two choices leaves the stack at a bucket where the other keeps
    it (_on_stack) pays those calls."""
    n = len(lm.BUCKET_ROWS)
    free, inv = [], []
    for sc in shapes:
        # (inf: a bucket a method failed at, or may not be chosen for: lm.eligible)
        timed = {m: t for m, t in sc.times_us.items() if any(map(math.isfinite, t))}
        if not timed:  # one candidate (checked, not timed), or none passed
            one = next((m for m in sc.candidates if m not in sc.failed), sc.methods[0])
            free.append([one] * n)
            inv.append(free[-1] if one in sc.invariant else None)
            continue
        free.append(_one_dequantised_copy(sc, choose(timed, sc.methods[0])))
        whole = {m for m, t in timed.items() if all(map(math.isfinite, t))}
        inv.append(choose(timed, sc.methods[0], True, invariant=sc.invariant)
                   if set(sc.invariant) & whole else None)
    if stack:
        _stack_choice(shapes, free, stack)
    possible_inv = all(i is not None for i in inv)
    if stack and possible_inv:
        on_free, on_inv = _on_stack(shapes, free, stack), _on_stack(shapes, inv, stack)
    cost = []
    for b in range(n):
        t_free = t_inv = 0.0
        for sc, f, i in zip(shapes, free, inv):
            if i is not None and f[b] in sc.times_us and i[b] in sc.times_us:
                t_free += len(sc.names) * sc.times_us[f[b]][b]
                t_inv += len(sc.names) * sc.times_us[i[b]][b]
        if stack and possible_inv:  # whichever leaves the stack where the other keeps it pays
            free_on, inv_on = on_free[b], on_inv[b]
            t_inv += stack.saved_us() * (free_on and not inv_on)
            t_free += stack.saved_us() * (inv_on and not free_on)
        cost.append(t_inv / t_free if t_free else 1.0)
    possible = possible_inv
    use = batch_invariant is True or (batch_invariant is None and possible
                                      and max(cost) <= INVARIANCE_COST)
    for sc, f, i in zip(shapes, free, inv):
        sc.methods = i if use and i is not None else f
    report.batch_invariant = use and possible
    report.invariance_cost = cost if possible else []


def _on_stack(shapes: list[ShapeChoice], choice: list[list[str]], stack: StackCost) -> list[bool]:
    """Per bucket, whether a choice (a method per shape and bucket) runs that bucket's
    decode steps on a DecodeStack: every stack shape on a stack method there (the model
    binds a stack for each run of buckets on the same modules)."""
    return [all(c[b] in STACK_METHODS for sc, c in zip(shapes, choice) if sc.key in stack.keys)
            for b in range(len(lm.BUCKET_ROWS))]


def _whole_layer_ok(mod: nn.Module, src: nn.Module, act: torch.dtype) -> bool:
    """Whether each method of a layer the tuner measured on a slice (_slice_outputs) over
    8 rows passes the known-answer check on the whole layer, at 71 rows (past the
    one-row and few-row paths, with a tail in every row block; measure checked 1 and 8)."""
    impls = mod.impls if isinstance(mod, lm.BucketedLinear) else [mod]
    g = torch.Generator().manual_seed(1)
    x = check_input(src, 71, g, act)
    ref_w, rows = lm.reference_weight(src), _check_rows(71)
    want = reference_output(ref_w, src.bias, x[rows])
    return all(known_answer(m, ref_w, src.bias, x, want, rows) for m in impls)


def _swap(src: nn.Module, methods: list[str], act: torch.dtype) -> nn.Module:
    built: dict[str, nn.Module] = {}
    with unpacked_once():  # an int4 layer unpacked once for all its buckets' methods
        for m in methods:
            if m not in built:
                built[m] = lm.build(m, src, act)
    if len(built) == 1:
        return next(iter(built.values()))
    return lm.BucketedLinear([built[m] for m in methods], methods)



def linear_summary(model: nn.Module) -> str:
    """How many linear layers run each method, bucket by bucket, and the DecodeStack's
    reach: one line each, for logs and `servelm tune`."""
    from servelm.quantization.formats import QuantLinear
    from servelm.prepack import PackedLinear

    def name(m: nn.Module) -> str:
        if isinstance(m, PackedLinear):
            return "onednn"
        if isinstance(m, lm.Int4PackLinear):
            return "int4pack"
        if isinstance(m, lm.qdot.QDotLinear):
            return "qdot"
        if isinstance(m, lm.gemv.GemvLinear):
            return "gemv_rows" if m.by_row else "gemv"
        if isinstance(m, (lm.panels.PanelLinear, lm.panels.Int4PanelLinear,
                          lm.panels.Int8PanelLinear)):
            return "panels"
        if isinstance(m, lm.q8act.Int4Q8Linear):
            return "q8act"
        if isinstance(m, lm.bfp.BfpLinear):
            return "bfp"
        if isinstance(m, lm.amx.AmxLinear):
            return "amx"
        if isinstance(m, lm.w8a8.W8A8Linear):
            return "w8a8_amx" if m.tiles else "w8a8_pairs" if m.pairs else "w8a8"
        if isinstance(m, QuantLinear):
            tiled = m.use_kernel and getattr(m, "tiled", True)
            return "tiles" if tiled else ("int8pack" if m.method == "int8" else "torch")
        return "torch"

    inner = {id(i) for b in model.modules() if isinstance(b, lm.BucketedLinear)
             for i in b.impls}
    inner |= {id(b.src) for b in model.modules() if isinstance(b, lm._Dequantised)}
    kinds = (nn.Linear, QuantLinear, PackedLinear, lm.Int4PackLinear, lm.qdot.QDotLinear,
             lm.gemv.GemvLinear, lm.panels.PanelLinear, lm.panels.Int4PanelLinear,
             lm.panels.Int8PanelLinear, lm.q8act.Int4Q8Linear, lm.bfp.BfpLinear,
             lm.amx.AmxLinear, lm.w8a8.W8A8Linear, lm._Dequantised, lm.BucketedLinear)
    layers = [m for m in model.modules() if isinstance(m, kinds) and id(m) not in inner]
    lines = [f"{len(layers)} linear layers"]
    for i, rows in enumerate(lm.BUCKET_ROWS):
        counts: dict[str, int] = {}
        for m in layers:
            impl = m._by_bucket[i] if isinstance(m, lm.BucketedLinear) else m
            counts[name(impl)] = counts.get(name(impl), 0) + 1
        lines.append(f"  {rows:>3} rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if getattr(model, "fused_decode", False):
        ranges = ", ".join(f"{lo}-{hi}" for lo, hi in model.decode_stack_ranges())
        lines.append(f"  DecodeStack: decode-only steps of {ranges} rows")
    return "\n".join(lines)
