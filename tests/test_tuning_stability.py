"""Kernel tables a noisy spell cannot spoil (servelm.tuning's stability checks,
servelm.retune): unstable timings are detected and timed again, a table still unstable is
served but not cached (provisional), decode steps far off the table's prediction mark it
suspect, and an idle engine measures it again and caches the result. Every timing here is
faked (tuning._time_sweep, the one round's sample): nothing depends on this machine's speed."""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from servelm import retune, tuning, tuning_cache
from servelm.config import KernelConfig
from servelm.layers import linear_methods as lm

ROWS = lm.BUCKET_ROWS
# The real checks, as imported (conftest's _steady_kernel_timings replaces them for the
# rest of the suite while it runs).
_REAL_CHECKS = {"_unstable_rounds": tuning._unstable_rounds,
                "_non_monotone": tuning._non_monotone,
                "_slow_shapes": tuning._slow_shapes,
                "_busy_reason": tuning._busy_reason}


class _Window:
    """tuning._load_window faked: the machine's contention over every window (a share of
    the tuner's threads' CPU time other processes took)."""

    share = 0.0
    threads = 2

    def contention(self):
        return _Window.share


@pytest.fixture(autouse=True)
def _real_stability_checks(monkeypatch):
    for name, fn in _REAL_CHECKS.items():
        monkeypatch.setattr(tuning, name, fn)
    # The machine quiet unless a test says otherwise (the suite's other worker is not).
    monkeypatch.setattr(_Window, "share", 0.0)
    monkeypatch.setattr(tuning, "_load_window", _Window)
    # The re-tuners alive in this process: only this test's (the suite's other engines, a
    # session fixture's among them, would make every window "not alone").
    monkeypatch.setattr(retune, "_LIVE", weakref.WeakSet())


def _base_s(rows: int) -> float:
    """A quiet machine's seconds per call: 10 µs a row (grows with the rows)."""
    return rows * 1e-5


def _quiet(rows: int, n: int, torch_method: bool) -> float:
    """The reference method ("torch", nn.Linear) at _base_s, every other 10% slower."""
    return _base_s(rows) * (1.0 if torch_method else 1.1)


class _FakeSweeps:
    """tuning._time_sweep faked: the n-th round of a (module, rows) takes
    script(rows, n, torch_method) seconds (torch_method: the module is the "torch" method's,
    an nn.Linear); counts the rounds by (torch_method, rows). A checked call (each bucket's
    first, tuning._timed_call) takes the n = 0 round's time."""

    def __init__(self, monkeypatch, script=_quiet):
        self.script = script
        self.seen: dict[tuple[int, int], int] = {}
        self.rounds: dict[tuple[bool, int], int] = {}
        monkeypatch.setattr(tuning, "_time_sweep", self)
        monkeypatch.setattr(tuning, "_timed_call", lambda mod, x: (
            mod(x), self.script(x.shape[0], 0, type(mod) is nn.Linear)))

    def __call__(self, mods, x) -> float:
        rows, torch_method = x.shape[0], type(mods[0]) is nn.Linear
        key = (id(mods[0]), rows)
        n = self.seen.get(key, 0)
        self.seen[key] = n + 1
        self.rounds[torch_method, rows] = self.rounds.get((torch_method, rows), 0) + 1
        return self.script(rows, n, torch_method)


def _methods() -> list[str]:
    """The methods an fp32 64x96 layer can run here ("torch" and at least one more, or the
    test skips: with one there is no choice for noise to spoil)."""
    src = nn.Linear(64, 96)
    cands = [m for m in lm.METHODS if lm.applies(m, src, torch.float32, True)
             and lm.tunable(m, torch.float32)]
    if len(cands) < 2:
        pytest.skip("one linear method here: nothing to measure")
    return cands


def _measure(stab: tuning.Stability):
    torch.manual_seed(0)
    srcs = [nn.Linear(64, 96), nn.Linear(64, 96)]
    return tuning.measure(srcs, _methods(), torch.float32, stability=stab)


def _busy(at_rows: int, rounds):
    """_quiet, but the torch method 3x slower at `at_rows` in the rounds `rounds(n)` holds."""
    def script(rows, n, torch_method):
        slow = torch_method and rows == at_rows and rounds(n)
        return _quiet(rows, n, torch_method) * (3 if slow else 1)
    return script


# ---------------------------------------------------------------- inside the measurement

def test_noisy_rounds_are_detected_and_timed_again(monkeypatch):
    """The fastest method at one row busy in most of its first rounds (its best round
    quiet): by median rounds another method is ahead, so the bucket is timed again, the
    rounds pooled, and the shape is trusted with the quiet time."""
    _FakeSweeps(monkeypatch, _busy(1, lambda n: 1 <= n <= tuning.MAX_REPS - 1))
    stab = tuning.Stability()
    times, failed, _ = _measure(stab)
    assert not failed and not stab.unstable, stab.reasons
    assert stab.retries == 1
    assert times["torch"][0] == pytest.approx(10.0)


def _machine_busy(at_rows: int):
    """A busy machine at `at_rows`, for good: the torch method 3x slower in four rounds of
    five, every other method 2x slower in three: every method's rounds disagree, and by
    medians the others are ahead."""
    def script(rows, n, torch_method):
        busy = rows == at_rows and (n % 5 != 0 if torch_method else n % 5 in (1, 2, 3))
        return _quiet(rows, n, torch_method) * ((3 if torch_method else 2) if busy else 1)
    return script


def test_rounds_still_noisy_after_the_retries_make_the_shape_unstable(monkeypatch):
    """A machine busy in most rounds, for good: still disagreeing after STABLE_RETRIES."""
    _FakeSweeps(monkeypatch, _machine_busy(8))
    stab = tuning.Stability()
    _measure(stab)
    assert stab.unstable and stab.retries == tuning.STABLE_RETRIES
    assert any(r.startswith("torch at 8 rows") and "rounds disagree" in r
               for r in stab.reasons), stab.reasons


def test_a_methods_own_noise_is_settled_by_the_medians(monkeypatch):
    """The fastest method alone busy in four rounds of five, for good, every other steady:
    the noise is that kernel's own, so it counts at its median round there, a steady method
    is chosen, and the shape is trusted after the retries."""
    _FakeSweeps(monkeypatch, _busy(8, lambda n: n % 5 != 0))
    stab = tuning.Stability()
    times, failed, _ = _measure(stab)
    assert not failed and not stab.unstable, stab.reasons
    assert stab.retries == tuning.STABLE_RETRIES
    assert times["torch"][1] == pytest.approx(3 * 80.0)  # its median: a busy round
    pick = tuning.choose(times, "torch")
    assert pick[1] != "torch" and pick[0] == "torch", pick


def test_noise_that_changes_no_choice_is_not_instability(monkeypatch):
    """The same busy rounds with the torch method far ahead of every other: the choice
    stands whichever rounds are believed."""
    noisy = _busy(8, lambda n: n % 5 != 0)
    _FakeSweeps(monkeypatch, lambda rows, n, t: noisy(rows, n, t) * (1 if t else 10))
    stab = tuning.Stability()
    _measure(stab)
    assert not stab.unstable and stab.retries == 0


def test_a_quiet_measurement_is_not_timed_again(monkeypatch):
    fake = _FakeSweeps(monkeypatch)
    stab = tuning.Stability()
    _measure(stab)
    assert not stab.unstable and stab.retries == 0
    assert all(fake.rounds[True, r] <= tuning.MAX_REPS for r in ROWS)  # one timing a bucket


def test_timer_jitter_on_a_tiny_call_is_not_instability(monkeypatch):
    """The fastest method's rounds twice its best, and behind another's by median: but by
    less than JITTER_US a call (a small layer's timer noise)."""
    _FakeSweeps(monkeypatch, lambda rows, n, t: (2e-6 if n == 0 else 4e-6) if t else 2.2e-6)
    stab = tuning.Stability()
    _measure(stab)
    assert not stab.unstable and stab.retries == 0


def _slow_first_bucket(factor_later: float):
    """Every method 20x slow at one row in its first timing's rounds (a spell covering the
    whole bucket: the rounds agree), factor_later x in later timings."""
    def script(rows, n, torch_method):
        f = (20 if n < tuning.MAX_REPS else factor_later) if rows == 1 else 1
        return _quiet(rows, n, torch_method) * f
    return script


def test_a_bucket_timed_faster_than_a_smaller_one_is_detected_and_timed_again(monkeypatch):
    """One row timed slower than 8 rows: both are timed again, the quiet times kept."""
    _FakeSweeps(monkeypatch, _slow_first_bucket(1))
    stab = tuning.Stability()
    times, _, _ = _measure(stab)
    assert not stab.unstable, stab.reasons
    assert stab.retries == 2  # one row and 8 rows, once each
    assert times["torch"][0] == pytest.approx(10.0) and times["torch"][1] == pytest.approx(80.0)


def test_a_bucket_faster_than_a_smaller_one_again_and_again_is_the_kernels_own(monkeypatch):
    """Timed again, the same times: a kernel faster at more rows (amx pads one row to a
    tile), trusted."""
    _FakeSweeps(monkeypatch, _slow_first_bucket(20))
    stab = tuning.Stability()
    times, _, _ = _measure(stab)
    assert not stab.unstable and stab.retries == 2, stab.reasons
    assert times["torch"][0] == pytest.approx(200.0)


def test_a_bucket_faster_than_a_smaller_one_with_times_that_moved_is_unstable(monkeypatch):
    _FakeSweeps(monkeypatch, _slow_first_bucket(40))
    stab = tuning.Stability()
    _measure(stab)
    assert any("faster at 8 rows than at 1" in r for r in stab.reasons), stab.reasons


def test_the_monotone_check_compares_only_buckets_timed_alike():
    """8 rows (a sweep, from memory) may take longer than 64 (one layer, from cache); 512
    rows clearly faster than 64, or 8 faster than 1, may not. A method far behind the best
    is never chosen, so its pairs are not checked; nor are buckets it was scaled to."""
    timed = [{"a", "b"}] * 4
    ok = {"a": [10.0, 12.0, 11.0, 90.0]}
    assert tuning._non_monotone(ok, timed) == []
    assert tuning._non_monotone({"a": [10.0, 12.0, 50.0, 30.0]}, timed) == [("a", 2, 3)]
    assert tuning._non_monotone({"a": [20.0, 10.0, 50.0, 400.0]}, timed) == [("a", 0, 1)]
    assert tuning._non_monotone({"a": [10.0, 12.0, 50.0, 30.0]}, [{"a"}] * 3 + [set()]) == []
    far = {"a": [10.0, 12.0, 50.0, 400.0], "b": [100.0, 60.0, 500.0, 4000.0]}
    assert tuning._non_monotone(far, timed) == []


# ---------------------------------------------------------------- provisional tables

class _Block(nn.Module):
    """Two layers of each of two shapes, named as a model's are."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.qkv_proj = nn.Linear(64, 96, bias=True)
            layer.down_proj = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return [(layer.qkv_proj(x), layer.down_proj(torch.cat([x, x], -1)))
                for layer in self.layers]


_noisy = _machine_busy(8)  # a machine busy at 8 rows, for good


def _cfg(tmp_path, **kw):
    return KernelConfig(tuning_cache_dir=str(tmp_path), **kw)


def _cache_files(tmp_path):
    return list(tmp_path.glob("linear-methods-*.json"))


def test_a_table_still_unstable_is_served_not_cached_and_reported_provisional(tmp_path,
                                                                             monkeypatch):
    _FakeSweeps(monkeypatch, _noisy)
    model = _Block()
    x = torch.randn(3, 64)
    want = model(x)
    report = tuning.finalize_linears(model, None, _cfg(tmp_path, tuning="fresh"))
    assert report.source == "measured" and report.provisional
    assert all(s.unstable for s in report.shapes)
    assert not _cache_files(tmp_path)  # not cached
    table = report.table()
    assert "PROVISIONAL" in table and "unstable: " in table and "rounds disagree" in table
    for (a, b), (c, d) in zip(model(x), want):  # served: the layers run their methods
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b, d, rtol=1e-4, atol=1e-4)
    assert report.plan is not None and {p.key for p in report.plan.shapes} == {
        s.key for s in report.shapes}


def test_only_fresh_shapes_far_under_the_tables_rate_are_slow(monkeypatch):
    rates = {"a": 10.0, "b": 11.0, "c": 10.0, "d": 4.0, "e": 4.5}  # median 10
    assert tuning._slow_shapes(rates, {"a", "d", "e"}) == {"d": pytest.approx(0.4),
                                                           "e": pytest.approx(0.45)}
    assert tuning._slow_shapes(rates, {"a", "b"}) == {}  # d and e were cached: not judged
    assert tuning._slow_shapes({"a": 10.0, "d": 1.0}, {"d"}) == {}  # too few to compare
    monkeypatch.setattr(tuning, "RATE_SPREAD", 3.0)
    assert tuning._slow_shapes(rates, {"d", "e"}) == {}


class _Three(nn.Module):
    """One layer of each of three shapes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Module()])
        layer = self.layers[0]
        layer.qkv_proj = nn.Linear(64, 96, bias=False)
        layer.o_proj = nn.Linear(96, 64, bias=False)
        layer.down_proj = nn.Linear(128, 64, bias=False)


def _spell_on(monkeypatch, shape: tuple[int, int], slow_measures: set[int],
              always: bool = False):
    """Timings in proportion to a call's multiply-adds (the reference method 10% ahead),
    3x slower for every method and every round of `shape`'s measure() calls numbered in
    slow_measures (from 1), or of every timing of it (always): a spell over one shape's
    whole measurement, which the checks inside it cannot see. Returns the count of measure()
    calls per (in, out) shape."""
    calls: dict[tuple[int, int], int] = {}
    real = tuning.measure

    def measure(srcs, *a, **k):
        key = (srcs[0].in_features, srcs[0].out_features)
        calls[key] = calls.get(key, 0) + 1
        return real(srcs, *a, **k)

    def seconds(mod, x, out) -> float:
        k, n = x.shape[-1], out.shape[-1]
        t = x.shape[0] * k * n * 1e-9 * (1.0 if type(mod) is nn.Linear else 1.1)
        slow = (k, n) == shape and (always or calls.get(shape) in slow_measures)
        return t * (3 if slow else 1)

    def timed_call(mod, x):
        out = mod(x)
        return out, seconds(mod, x, out)

    monkeypatch.setattr(tuning, "measure", measure)
    monkeypatch.setattr(tuning, "_timed_call", timed_call)
    monkeypatch.setattr(tuning, "_time_sweep", lambda mods, x: seconds(mods[0], x, mods[0](x)))
    monkeypatch.setattr(tuning, "RATE_MIN_OPS", 0)
    return calls


def test_a_shape_timed_in_a_spell_of_its_own_is_measured_again_and_trusted(tmp_path,
                                                                           monkeypatch):
    calls = _spell_on(monkeypatch, (96, 64), {1})
    report = tuning.finalize_linears(_Three(), None, _cfg(tmp_path, tuning="fresh"))
    assert calls[96, 64] == 2 and calls[64, 96] == 1 and calls[128, 64] == 1
    assert not report.provisional and len(_cache_files(tmp_path)) == 1
    o = next(s for s in report.shapes if "o_proj" in s.names[0])
    assert o.times_us["torch"][-1] == pytest.approx(lm.BUCKET_ROWS[-1] * 96 * 64 * 1e-3)


def test_a_shape_still_off_the_tables_rate_makes_it_provisional(tmp_path, monkeypatch):
    calls = _spell_on(monkeypatch, (96, 64), {1, 2})
    report = tuning.finalize_linears(_Three(), None, _cfg(tmp_path, tuning="fresh"))
    assert calls[96, 64] == 2 and report.provisional and not _cache_files(tmp_path)
    o = next(s for s in report.shapes if "o_proj" in s.names[0])
    assert any("the other shapes' rate, twice" in r for r in o.unstable), o.unstable
    assert "PROVISIONAL" in report.table()


def test_a_stable_table_is_cached_as_before(tmp_path, monkeypatch):
    _FakeSweeps(monkeypatch)
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert report.source == "measured" and not report.provisional
    assert "PROVISIONAL" not in report.table()
    assert len(_cache_files(tmp_path)) == 1
    again = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert again.source == "cached" and not again.provisional
    assert [s.methods for s in again.shapes] == [s.methods for s in report.shapes]


def test_a_table_measured_beside_other_jobs_is_served_not_cached(tmp_path, monkeypatch, caplog):
    """Rounds that agree, but other processes took half of what the tuner's threads could
    run: their jobs may have slowed one method's every round alike (a parallel region
    waiting on a parked thread), so the table is provisional; a little background is not."""
    _FakeSweeps(monkeypatch)
    monkeypatch.setattr(_Window, "share", 0.5)
    with caplog.at_level("WARNING", logger="servelm.tuning"):
        report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert report.provisional and not _cache_files(tmp_path)
    assert not any(s.unstable for s in report.shapes)  # no shape's rounds disagreed
    assert "other processes took 50%" in report.busy and "other processes took 50%" in caplog.text
    assert "PROVISIONAL: other processes took 50% of the CPU time its 2 threads" in report.table()
    assert report.plan is not None  # measured again when idle
    monkeypatch.setattr(_Window, "share", tuning.BUSY_SHARE / 2)
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert not report.provisional and report.busy is None and len(_cache_files(tmp_path)) == 1
    monkeypatch.setattr(_Window, "share", 0.9)  # a cached table: nothing measured, no verdict
    again = tuning.finalize_linears(_Block(), None, _cfg(tmp_path))
    assert again.source == "cached" and not again.provisional


def test_the_cli_says_a_tuned_table_is_provisional(tmp_path, monkeypatch, capsys):
    from servelm import cli

    report = tuning.TuningReport([], source="measured", provisional=True)
    llm = SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(
        tuning=report, model=nn.Module())))
    monkeypatch.setattr(cli, "build_llm", lambda args: llm)
    monkeypatch.setattr(tuning, "linear_summary", lambda model: "0 linear layers")
    assert cli.cmd_tune(SimpleNamespace(kv_cache_memory=None)) == 0
    out = capsys.readouterr().out
    assert "PROVISIONAL" in out and "not cached" in out


@pytest.mark.parametrize("longest", [None, 128, 64])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_a_synthetic_source_has_the_shapes_format_and_key(fmt, longest):
    """What an idle re-tune times in place of a swapped layer has its shape key, a
    calibrated layer's longest activation block too."""
    from servelm.quantization.surgery import quantize_linear

    lin = nn.Linear(64, 96)
    src = (quantize_linear(lin, fmt) if fmt.startswith("int")
           else lin.to(getattr(torch, fmt)))
    if longest:
        lm.w8a8.set_calibration(src, torch.rand(64) + 0.5, longest)
    act = torch.float32
    key = tuning._shape_key(src, act)
    assert key.endswith({None: ":bias", 128: ":smooth", 64: ":smooth64"}[longest])
    plan = tuning.PlannedShape(key, key, lm.weight_format(src), 64, 96, True, 2, ["torch"],
                               "torch")
    made = tuning.synthetic_source(plan, fast=True)
    assert tuning._shape_key(made, act) == key
    assert torch.isfinite(lm.reference_weight(made)).all()


# ---------------------------------------------------------------- drift

PREDICTED = [100.0, 150.0, 400.0, 3000.0]  # µs per bucket's row count


def test_drift_fires_on_steps_well_off_the_prediction():
    mon = retune.DriftMonitor(PREDICTED, reference=[1.0] * 4, window=32)
    fired = [mon.record(1, 60e-6) for _ in range(32)]  # 1.67x faster than the reference
    assert fired == [False] * 31 + [True]
    assert mon.suspect and "1-row" in mon.suspect


def test_drift_does_not_fire_near_the_prediction_or_on_slower_steps():
    mon = retune.DriftMonitor(PREDICTED, reference=[1.0] * 4, window=32)
    for i in range(10 * 32):
        rows = (1, 5, 30, 100, 300)[i % 5]
        # the step: the matmuls' time and some more (attention, norms, sampling), with a
        # few steps far faster (a timer hiccup) that the window's median ignores
        fast = i % 11 == 0
        assert not mon.record(rows, mon.predict_us(rows) * (0.5 if fast else 1.1) * 1e-6)
        assert not mon.record(rows, mon.predict_us(rows) * 3e-6)
    assert mon.suspect is None


def test_drift_learns_its_reference_from_the_first_window():
    """Without a reference (none cached for this table) the first window's median becomes
    it: steps 0.45x the matmuls' summed times are this table's normal (one call for the
    whole step), and only a later window well under that fires."""
    mon = retune.DriftMonitor(PREDICTED, window=16)
    assert not any(mon.record(1, 45e-6) for _ in range(16))
    assert mon.learned == [0] and mon.reference[0] == pytest.approx(0.45)
    assert not any(mon.record(1, 40e-6) for _ in range(16))  # within DRIFT of it
    assert any(mon.record(1, 30e-6) for _ in range(16))
    frozen = retune.DriftMonitor(PREDICTED, window=16, learn=False)  # a provisional table
    assert not any(frozen.record(1, 10e-6) for _ in range(64)) and frozen.reference[0] is None


def test_drift_learns_nothing_while_another_engine_steps_in_the_process(tmp_path):
    """Two engines taking turns evict each other's weights: a window then is not this
    table's normal, and is not learned from; once the other engine is gone, the next is."""
    import gc

    def retuner():
        return retune.IdleRetuner(_plan(tmp_path), False, PREDICTED)

    first, second = retuner(), retuner()
    first.drift.window = 16
    assert not any(first.drift.record(1, 45e-6) for _ in range(16))
    assert first.drift.reference[0] is None and not first.drift.learned
    del second
    gc.collect()
    assert not any(first.drift.record(1, 45e-6) for _ in range(16))
    assert first.drift.reference[0] == pytest.approx(0.45)


def test_the_prediction_is_interpolated_between_buckets():
    mon = retune.DriftMonitor(PREDICTED)
    assert mon.predict_us(1) == 100.0 and mon.predict_us(8) == 150.0
    assert mon.predict_us(36) == pytest.approx(275.0)
    assert mon.predict_us(1024) == pytest.approx(6000.0)


def test_predicted_us_sums_the_chosen_methods_over_the_layers():
    a = tuning.ShapeChoice("a", ["x", "y"], ["m", "m", "n", "n"],
                           {"m": [1.0, 2.0, 30.0, 300.0], "n": [5.0, 6.0, 7.0, 8.0]}, [])
    b = tuning.ShapeChoice("b", ["z"], ["m"] * 4, {"m": [10.0, 20.0, 30.0, 40.0]}, [])
    assert retune.predicted_us(tuning.TuningReport([a, b])) == [12.0, 24.0, 44.0, 56.0]


# ---------------------------------------------------------------- re-tuning when idle

class _Clock:
    def __init__(self):
        self.now = 0.0
        self.slept = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept += 1


def _plan(tmp_path) -> tuning.RetunePlan:
    src = nn.Linear(64, 96)
    key = tuning._shape_key(src, torch.float32)
    shape = tuning.PlannedShape(key, key, "float32", 64, 96, True, 2, _methods(), "torch")
    machine = tuning_cache.machine_key(torch.get_num_threads())
    return tuning.RetunePlan(tmp_path, machine, torch.float32, True, False, [shape])


def _decode_step(rows: int):
    req = SimpleNamespace(num_prompt_tokens=4)
    return SimpleNamespace(scheduled=[SimpleNamespace(num_new_tokens=1, num_draft=0, start=9,
                                                      request=req)] * rows)


def _retuner(tmp_path, provisional=True) -> tuple[retune.IdleRetuner, _Clock]:
    clock = _Clock()
    r = retune.IdleRetuner(_plan(tmp_path), provisional, PREDICTED, idle_after=30.0,
                           clock=clock, sleep=clock.sleep, fingerprint="t")
    return r, clock


def _run_idle(r: retune.IdleRetuner, clock: _Clock, limit: int = 500) -> int:
    """Idle pieces until the re-tuner has nothing to do or waits (sleeps); how many ran."""
    pieces, slept = 0, clock.slept
    while r.idle_piece() and clock.slept == slept:
        pieces += 1
        assert pieces < limit
    return pieces


def test_the_idle_retune_waits_for_idle_then_writes_the_cache(tmp_path, monkeypatch):
    fake = _FakeSweeps(monkeypatch)
    r, clock = _retuner(tmp_path)
    r.record(_decode_step(4), 1e-3)
    clock.now = 10.0  # idle 10 s: not yet
    assert r.idle_piece() and clock.slept == 1 and not fake.rounds
    clock.now = 31.0
    assert r.idle_piece() and r.idle_piece()  # two pieces ...
    r.record(_decode_step(2), 1e-3)  # ... then a request: busy again
    rounds = dict(fake.rounds)
    clock.now = 50.0
    assert r.idle_piece() and fake.rounds == rounds  # waiting again, nothing measured
    assert not _cache_files(tmp_path)
    clock.now = 62.0
    assert _run_idle(r, clock) > len(ROWS)  # a piece at a time
    assert r.written and r.pending is None and r.attempts == 1
    cache = tuning_cache.TuningCache(tmp_path, r.plan.machine)
    key = r.plan.shapes[0].cache_key
    times = cache.get(key)["times_us"]
    assert set(times) == set(_methods())
    assert times["torch"] == pytest.approx([_base_s(n) * 1e6 for n in ROWS])
    assert not r.idle_piece()  # done: nothing more to do


def test_a_trusted_table_is_not_retuned_unless_the_steps_contradict_it(tmp_path, monkeypatch):
    """A trusted table's first window of one-row steps is its reference, cached beside it
    (a later start reads it back); a window well faster than it marks the table suspect,
    and the idle re-tune caches a new table (and drops the reference, taken against the
    old times)."""
    fake = _FakeSweeps(monkeypatch)
    r, clock = _retuner(tmp_path, provisional=False)
    clock.now = 100.0
    assert not r.idle_piece() and not fake.rounds
    for _ in range(retune.DRIFT_STEPS):  # 1 row: predicted 100 µs, steps take 80
        r.record(_decode_step(1), 80e-6)
    assert r.pending is None
    later, _ = _retuner(tmp_path, provisional=False)
    assert later.drift.reference[0] == pytest.approx(0.8)
    assert _retuner(tmp_path, provisional=True)[0].drift.reference == [None] * len(ROWS)
    for _ in range(retune.DRIFT_STEPS):  # now 40 µs: twice as fast against the table
        r.record(_decode_step(1), 40e-6)
    assert r.pending and "faster" in r.pending
    clock.now = 200.0
    _run_idle(r, clock)
    assert r.written
    cache = tuning_cache.TuningCache(tmp_path, r.plan.machine)
    assert cache.get(r.plan.shapes[0].cache_key) and cache.get(r.step_key) is None


def test_an_idle_retune_unstable_again_is_not_cached_and_gives_up(tmp_path, monkeypatch):
    _FakeSweeps(monkeypatch, _noisy)
    r, clock = _retuner(tmp_path)
    for attempt in range(1, retune.MAX_RETUNES + 1):
        clock.now += 100.0  # each attempt after another idle spell
        _run_idle(r, clock)
        assert r.attempts == attempt and not r.written and not _cache_files(tmp_path)
    assert r.pending is None and not r.idle_piece()


def test_an_idle_retune_beside_other_jobs_is_not_cached(tmp_path, monkeypatch):
    _FakeSweeps(monkeypatch)
    monkeypatch.setattr(_Window, "share", 0.5)
    r, clock = _retuner(tmp_path)
    clock.now += 100.0
    _run_idle(r, clock)
    assert r.attempts == 1 and not r.written and not _cache_files(tmp_path)
    monkeypatch.setattr(_Window, "share", 0.0)  # the jobs are gone at the next idle spell
    clock.now += 100.0
    _run_idle(r, clock)
    assert r.attempts == 2 and r.written and len(_cache_files(tmp_path)) == 1


@pytest.mark.parametrize("slow", [False, True])
def test_an_idle_retune_checks_the_shapes_rates_against_each_other(tmp_path, monkeypatch, slow):
    _spell_on(monkeypatch, (96, 64) if slow else (0, 0), set(), always=True)
    shapes = []
    for k, n in ((64, 96), (96, 64), (128, 64)):
        key = tuning._shape_key(nn.Linear(k, n), torch.float32)
        shapes.append(tuning.PlannedShape(key, key, "float32", k, n, True, 1, _methods(), "torch"))
    plan = tuning.RetunePlan(tmp_path, tuning_cache.machine_key(torch.get_num_threads()),
                             torch.float32, True, False, shapes)
    clock = _Clock()
    r = retune.IdleRetuner(plan, True, PREDICTED, clock=clock, sleep=clock.sleep)
    clock.now = 100.0
    _run_idle(r, clock)
    assert r.attempts == 1 and r.written is not slow
    assert bool(_cache_files(tmp_path)) is not slow


def test_the_config_turns_idle_retuning_off(tmp_path, monkeypatch):
    _FakeSweeps(monkeypatch, _noisy)
    report = tuning.finalize_linears(_Block(), None, _cfg(tmp_path, tuning="fresh"))
    assert report.provisional
    assert retune.IdleRetuner.of(report, _cfg(tmp_path, retune_when_idle=False)) is None
    r = retune.IdleRetuner.of(report, _cfg(tmp_path))
    assert r is not None and r.pending == "provisional"
    assert retune.IdleRetuner.of(tuning.TuningReport([]), _cfg(tmp_path)) is None


def test_the_engine_records_its_steps_and_retunes_only_when_idle(llm, tmp_path, monkeypatch):
    """Through the engine: a step marks it busy (no piece runs), commit_idle (what the
    server's engine thread calls with nothing to run) runs the pieces once it has been idle
    long enough, and the cache is written."""
    from servelm import SamplingParams

    engine = llm.engine
    r, clock = _retuner(tmp_path)
    monkeypatch.setattr(engine, "retuner", r)
    clock.now = 5.0
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0),
                 use_tqdm=False)
    assert r.last_busy == 5.0
    fake = _FakeSweeps(monkeypatch)
    clock.now = 20.0
    while engine.commit_idle() and clock.slept == 0:  # the KV pool's pages first
        pass
    assert not fake.rounds and not _cache_files(tmp_path)
    clock.now = 40.0
    pieces = 0
    while engine.commit_idle():
        pieces += 1
        assert pieces < 10_000
    assert r.written and _cache_files(tmp_path) and fake.rounds
