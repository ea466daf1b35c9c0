"""`servelm bench` run as a process of its own, as from the command line, for the benchmark
scripts that start servers and measure them side by side (benchmarks/serving.py,
benchmarks/compare.py); and a free loopback port for such a server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bench(url: str, *flags: str, echo: bool = False, strict: bool = False) -> dict:
    """`servelm bench --base-url url *flags`: its JSON summary. A RuntimeError (with the end
    of its stderr) if it fails; with `strict`, also if any request failed. `echo` prints the
    command line first, so it can be rerun by hand."""
    with tempfile.NamedTemporaryFile(prefix="servelm-bench-", suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "servelm.cli", "bench", "--base-url", url, "--no-progress",
           "--json", out, *flags]
    if echo:
        print("$", "servelm", " ".join(cmd[3:]), flush=True)
    try:
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"servelm bench {' '.join(flags)} failed: {r.stderr[-2000:]}")
        with open(out) as f:
            summary = json.load(f)["summary"]
    finally:
        os.unlink(out)
    if strict and summary["failed"]:
        raise RuntimeError(f"servelm bench {' '.join(flags)}: {summary['failed']} requests "
                           f"failed: {summary.get('errors')}")
    return summary
