"""benchmarks/decode_ab.py (one optimisation on and off, alternating in one process) and
compare.py's format variants and serving.py's sweep roofline: they run, and bad arguments are
usage errors naming them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import script_usage_error
from servelm import quantization as Q

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.skipif(not Q.kernels_available(), reason="needs the C++ kernels (AVX-512 BF16)")
@pytest.mark.parametrize("what,on,off", [("stack", "stack", "per-op"),
                                         ("hugepages", "huge pages", "plain pages")])
def test_decode_ab_reports_both_sides_and_their_ratio(what, on, off):
    r = _run("decode_ab.py", "--what", what, "--streams", "1,2", "--pairs", "2", "--tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    for n in (1, 2):
        m = re.search(rf"streams +{n}: {on} +([\d.]+) tok/s, {off} +([\d.]+) tok/s, ratio median "
                      r"([\d.]+) \(min ([\d.]+), max ([\d.]+)\)", r.stdout)
        assert m, r.stdout
        a, b, ratio, lo, hi = map(float, m.groups())
        assert a > 0 and b > 0 and lo <= ratio <= hi


@pytest.mark.parametrize("args,flag", [(("--streams", "1,x"), "--streams"),
                                       (("--streams", "0"), "--streams"),
                                       (("--pairs", "0"), "--pairs"),
                                       (("--what", "prefill"), "--what")])
def test_decode_ab_rejects_bad_arguments(args, flag, capsys):
    code, err = script_usage_error("decode_ab.py", *args, capsys=capsys)
    assert code == 2 and flag in err


def test_compare_rejects_an_unknown_format_variant(capsys):
    code, err = script_usage_error("compare.py", "--formats", "int4/bogus", "--skip-transformers",
                                   capsys=capsys)
    assert code != 0
    assert "unknown format variant 'bogus' in 'int4/bogus'" in err
    assert "tiles, onednn, torch, untuned, unfused, smallpages, eager" in err


def test_compare_rejects_an_unknown_transformers_dtype(capsys):
    code, err = script_usage_error("compare.py", "--formats", "int4", "--transformers-dtypes",
                                   "float32,int3", capsys=capsys)
    assert code == 2 and "--transformers-dtypes: unknown dtype 'int3'" in err


def test_compare_rejects_a_format_named_twice(capsys):
    # Every system is loaded at once and results are keyed by name: a repeat is a usage error.
    code, err = script_usage_error("compare.py", "--formats", "int4,bfloat16,int4",
                                   "--skip-transformers", capsys=capsys)
    assert code == 2 and "--formats names a format twice: 'int4,bfloat16,int4'" in err


def test_serving_sweep_rejects_a_non_positive_roofline(capsys):
    # The sweep's roofline defaults to the machine measured; a given one must be positive.
    for flag in ("--bandwidth", "--flops"):
        code, err = script_usage_error("serving.py", "sweep", flag, "0", capsys=capsys)
        assert code == 2 and f"argument {flag}: must be > 0" in err


@pytest.mark.parametrize("args", [("--duration", "0"), ("--clients", "0"), ("--warmup", "-1")])
def test_soak_rejects_bad_sizes(capsys, args):
    code, err = script_usage_error("soak.py", *args, capsys=capsys)
    assert code == 2 and "--duration" in err
