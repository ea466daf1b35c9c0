"""How much of this process's CPUs other processes took over a window of time (Linux's
/proc/stat), for the kernel tuner: timings taken while other jobs run are the jobs' as much
as the kernels'. Its rounds can agree with each other and still be wrong: a method whose
calls run in parallel regions waits for a thread the scheduler parked at every call, while
one running on one thread does not, and the table then prefers the wrong one.

A window counts, on the CPUs this process may run on (its affinity), the time they were busy
(user, nice, system, interrupts, and steal: time the hypervisor gave to another guest) less
this process's own (its threads' and its finished children's, such as a kernel build), and
compares what is left with what this process's threads could not have used anyway (CPUs
beyond its thread count: tensor-parallel ranks beside each other on one machine do not
disturb each other). No torch here.
"""

from __future__ import annotations

import os
import time

STAT = "/proc/stat"
# /proc/stat's fields of a cpuN line counted busy: user, nice, system, irq, softirq, steal
# (guest time is inside user); idle and iowait are not.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
MIN_WINDOW_S = 0.5  # /proc/stat counts in clock ticks (10 ms): shorter windows say little


def cpu_busy_s(cpus: list[int], path: str = STAT) -> float | None:
    """Seconds the CPUs `cpus` have been busy since boot (None: no such file or lines)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    want = {f"cpu{c}" for c in cpus}
    total, seen = 0, 0
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in want:
                    fields = rest.split()
                    total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
                    seen += 1
    except (OSError, ValueError):
        return None
    return total / tick if seen else None


def own_cpu_s() -> float:
    """This process's CPU seconds: its threads' and its waited-for children's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class LoadWindow:
    """Opened before a measurement; contention() after it says what share of the CPU time
    this process's `threads` threads could have used other processes took."""

    def __init__(self, threads: int, clock=time.monotonic, busy=cpu_busy_s, own=own_cpu_s,
                 cpus: list[int] | None = None):
        self.threads = max(1, threads)
        self.cpus = affinity() if cpus is None else cpus
        self._clock, self._busy, self._own = clock, busy, own
        self.t0, self.busy0, self.own0 = clock(), busy(self.cpus), own()

    def contention(self) -> float | None:
        """Other processes' busy time on this process's CPUs over the window, less the CPUs
        its threads leave spare, as a share of threads x the window (0: none; 1: as much as
        the threads could run; None: /proc/stat unread, or a window under MIN_WINDOW_S)."""
        wall = self._clock() - self.t0
        busy = self._busy(self.cpus)
        if busy is None or self.busy0 is None or wall < MIN_WINDOW_S:
            return None
        others = max(0.0, (busy - self.busy0) - (self._own() - self.own0))
        spare = max(0, len(self.cpus) - self.threads) * wall
        return max(0.0, others - spare) / (self.threads * wall)
