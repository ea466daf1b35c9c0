"""`servelm serve --data-parallel-size N`: N replicas of the server, each an ordinary
`servelm serve` child process on a loopback port of its own, with its own KV pool and its
share of the CPU cores (pinned with sched_setaffinity; its threads one per physical core of
its share), supervised here: a replica that exits is started again on the same port after
a pause (growing while it keeps failing). The front process runs the router over them
(servelm.router.serve)."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

_READY = re.compile(r"serving .* on (https?://\S+?)(/\S*)? \(")
# Flags of the front that no replica takes (each replica: its own loopback port and threads).
_FRONT_FLAGS = {"--data-parallel-size": 1, "--dp": 1, "--host": 1, "--port": 1,
                "--ssl-keyfile": 1, "--ssl-certfile": 1, "--root-path": 1,
                "--router-policy": 1, "--router-load-bound": 1, "--prefill-min-tokens": 1}


def _node_of(cpu: int) -> int:
    """The NUMA node of a CPU (0 where the kernel shows none)."""
    base = f"/sys/devices/system/cpu/cpu{cpu}"
    try:
        for name in os.listdir(base):
            if name.startswith("node") and name[4:].isdigit():
                return int(name[4:])
    except OSError:
        pass
    return 0


def core_groups(cpus: list[int] | None = None, node_of=_node_of) -> list[list[int]]:
    """The CPUs this process may run on, grouped by physical core (hyperthread siblings
    together), in (NUMA node, package, core) order: neighbouring groups share a node."""
    return [g for _, g in _keyed_groups(cpus, node_of)]


def _keyed_groups(cpus, node_of) -> list[tuple[tuple[int, int, int], list[int]]]:
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    groups: dict[tuple[int, int, int], list[int]] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                pkg = int(f.read())
            with open(f"{base}/core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):
            pkg, core = 0, cpu
        groups.setdefault((node_of(cpu), pkg, core), []).append(cpu)
    return sorted(groups.items())


def split_cores(n: int, groups: list[list[int]] | None = None,
                nodes: list[int] | None = None) -> list[list[int]]:
    """Each of n replicas' CPUs: the physical cores split into n contiguous runs as even as
    they go (a machine with fewer cores than replicas: replicas share them). nodes: each
    group's NUMA node (default: read here); where the replicas are a multiple of the nodes,
    each node's cores are split among its own replicas, so that none spans two nodes (its
    memory, first touched by its pinned threads, is then its node's)."""
    if groups is None:
        keyed = _keyed_groups(None, _node_of)
        groups, nodes = [g for _, g in keyed], [k[0] for k, _ in keyed]
    nodes = nodes or [0] * len(groups)
    distinct = sorted(set(nodes))
    if len(distinct) > 1 and n % len(distinct) == 0 and n // len(distinct) <= min(
            nodes.count(d) for d in distinct):
        return [share for d in distinct
                for share in split_cores(n // len(distinct),
                                         [g for g, k in zip(groups, nodes) if k == d])]
    if n <= len(groups):
        per, extra = divmod(len(groups), n)
        out, start = [], 0
        for i in range(n):
            take = per + (i < extra)
            out.append(sorted(c for g in groups[start:start + take] for c in g))
            start += take
        return out
    return [sorted(groups[i % len(groups)]) for i in range(n)]


def replica_argv(argv: list[str]) -> list[str]:
    """The front's command line (`[global flags] serve ...`) less the flags that are the
    front's own."""
    out, skip = [], 0
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name == "--disaggregate":  # its P:D is optional
            skip = int("=" not in a and i + 1 < len(argv)
                       and re.fullmatch(r"\d+:\d+", argv[i + 1]) is not None)
            continue
        if name in _FRONT_FLAGS:
            skip = 0 if "=" in a else _FRONT_FLAGS[name]
            continue
        out.append(a)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the front dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class Replica:
    """One replica: its command, CPUs and port; the process running now."""

    def __init__(self, index: int, argv: list[str], cpus: list[int], threads: int | None,
                 env: dict[str, str] | None = None):
        self.index = index
        self.cpus = cpus
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = threads
        self.cmd = [sys.executable, "-m", "servelm.cli", *argv,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        if threads is not None:
            self.cmd += ["--threads", str(threads)]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.starts = 0
        self.last_exit: int | None = None

    def start(self) -> None:
        self.ready.clear()
        cpus = self.cpus

        def setup():
            _die_with_parent()
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=setup, env=self.env,
                                     text=True, errors="replace", bufsize=1)
        self.starts += 1
        threading.Thread(target=self._echo, args=(self.proc,), daemon=True,
                         name=f"replica-{self.index}-log").start()

    def _echo(self, proc: subprocess.Popen) -> None:
        """The replica's output on the front's stderr, each line marked; readiness seen."""
        for line in proc.stdout:
            if _READY.search(line):
                self.ready.set()
            sys.stderr.write(f"[replica {self.index}] {line}")
        sys.stderr.flush()

    def stop(self, timeout: float = 20.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Replicas:
    """N replicas started, waited for, restarted when they exit, and stopped."""

    def __init__(self, n: int, argv: list[str], threads: int | None = None,
                 cpus: list[list[int]] | None = None, restart_delay: float = 1.0,
                 env: dict[str, str] | None = None, extra: list[list[str]] | None = None):
        """extra: each replica's own flags after argv (disaggregation: its --role)."""
        if n < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
        shares = cpus or split_cores(n)
        extra = extra or [[]] * n
        self.replicas = [Replica(i, [*argv, *extra[i]], shares[i],
                                 threads if threads is not None
                                 else len(core_groups(shares[i])), env)
                         for i in range(n)]
        self.restart_delay = restart_delay
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self, timeout: float = 600.0) -> None:
        """Start every replica and wait until each serves; ValueError if one exits first."""
        for r in self.replicas:
            r.start()
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            while not r.ready.wait(0.1):
                if r.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ValueError(f"replica {r.index} did not start (exit status "
                                     f"{r.proc.poll()}); its output is above")
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name="replica-supervisor")
        self._thread.start()

    def _supervise(self) -> None:
        delays = {r.index: self.restart_delay for r in self.replicas}
        while not self._stopping.wait(0.2):
            for r in self.replicas:
                code = r.proc.poll()
                if code is None or self._stopping.is_set():
                    if code is None and r.ready.is_set():
                        delays[r.index] = self.restart_delay
                    continue
                r.last_exit = code
                logger.warning("replica %d exited with status %s: restarting it in %.0f s",
                               r.index, code, delays[r.index])
                print(f"servelm: replica {r.index} exited ({code}); restarting it",
                      file=sys.stderr, flush=True)
                if self._stopping.wait(delays[r.index]):
                    return
                delays[r.index] = min(delays[r.index] * 2, 30.0)
                r.start()

    def stop(self) -> None:
        self._stopping.set()
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            r.stop()
