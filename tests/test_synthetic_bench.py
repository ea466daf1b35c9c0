"""benchmarks/synthetic.py (random weights of real shapes, for machines without the model
file) runs end to end on CPU and reports against the roofline."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import script_usage_error

ROOT = Path(__file__).resolve().parents[1]


def test_synthetic_benchmark_runs_on_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "synthetic.py"), "--device", "cpu",
                        "--prompt", "32", "--context", "40", "--batch", "1,3", "--reps", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "smollm2-135m (0.13 B params), bfloat16, CPU" in out
    assert re.search(r"TTFT, 32-token prompt: +[\d.]+ ms +roofline +[\d.]+ ms", out)
    for b in (1, 3):
        m = re.search(rf"decode, batch +{b}, context 40: +([\d.]+) tok/s", out)
        assert m and float(m.group(1)) > 0


def test_synthetic_benchmark_rejects_bad_batch_sizes(capsys):
    for bad in ("1,x", "0"):
        code, err = script_usage_error("synthetic.py", "--device", "cpu", "--batch", bad,
                                       capsys=capsys)
        assert code == 2 and "--batch" in err


def test_synthetic_benchmark_rejects_modes_it_cannot_run(capsys):
    # CUDA graphs and the gather comparison need a GPU; an unknown mode or a non-positive
    # --hf-tokens is named.
    for args, name in ((["--modes", "graphs"], "--modes"), (["--modes", "eager,gather"], "--modes"),
                       (["--modes", "eager,fast"], "--modes"),
                       (["--hf-tokens", "0"], "--hf-tokens")):
        code, err = script_usage_error("synthetic.py", "--device", "cpu", *args, capsys=capsys)
        assert code == 2 and name in err
