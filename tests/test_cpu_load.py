"""servelm.cpu_load: the share of its threads' CPU time other processes took over a window,
from /proc/stat (written here) and the process's own CPU time and a clock (faked)."""

import pytest

from servelm import cpu_load


def _stat(tmp_path, ticks: dict[int, tuple[int, ...]]) -> str:
    """A /proc/stat with cpuN lines (user nice system idle iowait irq softirq steal ...)."""
    total = [sum(col) for col in zip(*ticks.values())]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{c} " + " ".join(map(str, t)) for c, t in ticks.items()]
    lines += ["intr 1 2 3", "ctxt 99"]
    path = tmp_path / "stat"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_busy_seconds_count_user_system_interrupts_and_steal_of_the_cpus_asked(tmp_path):
    tick = cpu_load.os.sysconf("SC_CLK_TCK")
    path = _stat(tmp_path, {0: (100, 5, 20, 999, 7, 1, 2, 3, 0, 0),
                            1: (10, 0, 0, 999, 0, 0, 0, 0, 0, 0),
                            2: (50, 0, 0, 0, 0, 0, 0, 0, 0, 0)})
    # idle (999) and iowait (7) are not busy
    assert cpu_load.cpu_busy_s([0, 1], path) == pytest.approx((131 + 10) / tick)
    assert cpu_load.cpu_busy_s([2], path) == pytest.approx(50 / tick)
    assert cpu_load.cpu_busy_s([7], path) is None  # no such CPU
    assert cpu_load.cpu_busy_s([0], str(tmp_path / "missing")) is None


class _Fake:
    """A window's inputs: the clock, the CPUs' busy seconds and this process's own."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 1000.0, 50.0

    def window(self, threads, cpus):
        return cpu_load.LoadWindow(threads, clock=lambda: self.now,
                                   busy=lambda c: None if self.busy is None else self.busy,
                                   own=lambda: self.own, cpus=cpus)

    def run(self, wall, own, others):
        self.now += wall
        self.own += own
        self.busy += own + others


def test_a_quiet_machine_has_no_contention():
    f = _Fake()
    w = f.window(2, [0, 1])
    f.run(wall=4.0, own=7.8, others=0.05)  # the tuner on both cores, a daemon's wakeups
    assert w.contention() == pytest.approx(0.05 / 8)


def test_two_jobs_on_the_tuners_cores_are_contention():
    """Two single-threaded jobs beside a two-thread tuning on two cores: each side gets
    about one core, so others took half of what the tuner's threads could use."""
    f = _Fake()
    w = f.window(2, [0, 1])
    f.run(wall=10.0, own=10.0, others=10.0)
    assert w.contention() == pytest.approx(0.5)


def test_other_processes_on_cpus_the_threads_leave_spare_are_no_contention():
    """A tensor-parallel rank's one thread tuning beside its peer rank on a two-core
    machine: the peer runs on the core this rank's thread does not need."""
    f = _Fake()
    w = f.window(1, [0, 1])
    f.run(wall=5.0, own=5.0, others=5.0)
    assert w.contention() == 0.0
    w = f.window(1, [0, 1])
    f.run(wall=5.0, own=3.0, others=7.0)  # more than the spare core: the excess counts
    assert w.contention() == pytest.approx(2.0 / 5.0)


def test_own_children_count_as_own(monkeypatch):
    """A kernel build (a child process, waited for) is the process's own time."""
    import os

    t = os.times()
    monkeypatch.setattr(cpu_load.os, "times", lambda: os.times_result(
        (1.0, 2.0, 3.0, 4.0, t.elapsed)))
    assert cpu_load.own_cpu_s() == pytest.approx(10.0)


def test_no_verdict_without_proc_stat_or_from_a_short_window():
    f = _Fake()
    w = f.window(2, [0, 1])
    f.run(wall=cpu_load.MIN_WINDOW_S / 2, own=0.5, others=0.5)
    assert w.contention() is None
    f.run(wall=5.0, own=1.0, others=1.0)
    f.busy = None  # /proc/stat unread at the window's end
    assert w.contention() is None
