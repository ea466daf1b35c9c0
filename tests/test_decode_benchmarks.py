"""benchmarks/decode_ab.py (one optimisation on and off, alternating in one process) and
compare.py's format variants and serving.py's sweep roofline: they run, and bad arguments are
usage errors naming them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import server_zygote
from helpers import script_usage_error
from servelm import quantization as Q

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT *args`, forked from a process that imported servelm once."""
    return server_zygote.run_script(ROOT / "benchmarks" / script, *args, cwd=str(ROOT),
                                    timeout=600)


@pytest.mark.skipif(not Q.kernels_available(), reason="needs the C++ kernels (AVX-512 BF16)")
@pytest.mark.parametrize("what,on,off", [("stack", "stack", "per-op"),
                                         ("hugepages", "huge pages", "plain pages")])
def test_decode_ab_reports_both_sides_and_their_ratio(what, on, off):
    # Untuned: the test is about the A/B's report, and two int4 engines measuring their
    # methods first took most of its time.
    r = _run("decode_ab.py", "--what", what, "--streams", "1,2", "--pairs", "2", "--tokens", "4",
             "--kernel-tuning", "off")
    assert r.returncode == 0, r.stderr[-2000:]
    for n in (1, 2):
        m = re.search(rf"streams +{n}: {on} +([\d.]+) tok/s, {off} +([\d.]+) tok/s, ratio median "
                      r"([\d.]+) \(min ([\d.]+), max ([\d.]+)\)", r.stdout)
        assert m, r.stdout
        a, b, ratio, lo, hi = map(float, m.groups())
        assert a > 0 and b > 0 and lo <= ratio <= hi


@pytest.mark.skipif(not Q.kernels_available(), reason="needs the C++ kernels (AVX-512 BF16)")
@pytest.mark.parametrize("args,method", [(("--linear-method", "q8act"), "q8act"),
                                         (("--quantization", "none", "--linear-method", "amx"),
                                          "amx")])
def test_decode_ab_runs_the_stack_on_the_method_asked_for(args, method):
    from servelm.layers import amx

    if method == "amx" and not amx.available():
        pytest.skip("no AMX-BF16 here")
    r = _run("decode_ab.py", "--what", "stack", "--streams", "1", "--pairs", "2", "--tokens", "4",
             "--kernel-tuning", "off", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(rf"  1 rows: .*\b{method} \d+", r.stdout), r.stdout
    assert "DecodeStack: decode-only steps" in r.stdout
    assert re.search(r"streams +1: stack +[\d.]+ tok/s, per-op +[\d.]+ tok/s", r.stdout), r.stdout


@pytest.mark.parametrize("args,flag", [(("--streams", "1,x"), "--streams"),
                                       (("--streams", "0"), "--streams"),
                                       (("--pairs", "0"), "--pairs"),
                                       (("--what", "prefill"), "--what"),
                                       (("--linear-method", "q8act", "--quantization", "none"),
                                        "--linear-method q8act runs int4"),
                                       (("--linear-method", "amx"), "--linear-method amx runs bf16")])
def test_decode_ab_rejects_bad_arguments(args, flag, capsys):
    code, err = script_usage_error("decode_ab.py", *args, capsys=capsys)
    assert code == 2 and flag in err


def test_kernels_rejects_an_unknown_method_or_bad_rows(capsys):
    code, err = script_usage_error("kernels.py", "--methods", "panels,bogus", capsys=capsys)
    assert code == 2 and "--methods: unknown bogus" in err and "q8act" in err
    for rows in ("8,x", "0", ""):
        code, err = script_usage_error("kernels.py", "--methods", "panels", "--rows", rows,
                                       capsys=capsys)
        assert code == 2 and "--rows must be positive integers" in err


def test_compare_rejects_an_unknown_format_variant(capsys):
    code, err = script_usage_error("compare.py", "--formats", "int4/bogus", "--skip-transformers",
                                   capsys=capsys)
    assert code != 0
    assert "unknown format variant 'bogus' in 'int4/bogus'" in err
    from servelm.layers.linear_methods import METHODS

    # every linear method, then the other variants
    assert ", ".join(METHODS + ("untuned", "unfused", "smallpages", "eager", "noint8act")) in err
    assert "w8a8, w8a8_pairs, w8a8_amx, torch, untuned" in err


def test_compare_rejects_an_unknown_transformers_dtype(capsys):
    code, err = script_usage_error("compare.py", "--formats", "int4", "--transformers-dtypes",
                                   "float32,int3", capsys=capsys)
    assert code == 2 and "--transformers-dtypes: unknown dtype 'int3'" in err


def test_compare_rejects_a_format_named_twice(capsys):
    # Every system is loaded at once and results are keyed by name: a repeat is a usage error.
    code, err = script_usage_error("compare.py", "--formats", "int4,bfloat16,int4",
                                   "--skip-transformers", capsys=capsys)
    assert code == 2 and "--formats names a format twice: 'int4,bfloat16,int4'" in err


def test_compare_rejects_a_non_positive_long_prompt(capsys):
    code, err = script_usage_error("compare.py", "--formats", "int4", "--long-prompt", "0",
                                   capsys=capsys)
    assert code == 2 and "argument --long-prompt: must be > 0" in err


def test_serving_sweep_rejects_a_non_positive_roofline(capsys):
    # The sweep's roofline defaults to the machine measured; a given one must be positive.
    for flag in ("--bandwidth", "--flops"):
        code, err = script_usage_error("serving.py", "sweep", flag, "0", capsys=capsys)
        assert code == 2 and f"argument {flag}: must be > 0" in err


@pytest.mark.parametrize("args", [("--duration", "0"), ("--clients", "0"), ("--warmup", "-1")])
def test_soak_rejects_bad_sizes(capsys, args):
    code, err = script_usage_error("soak.py", *args, capsys=capsys)
    assert code == 2 and "--duration" in err


# compare.py's peers (../shared/peers): found where its scripts put them, each left out with one
# line when it is not installed. Fake layouts only: no peer runs, nothing loads.
def _compare_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_compare_peers",
                                                  ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare():
    return _compare_module()


@pytest.fixture
def peers(tmp_path, monkeypatch):
    """A complete fake install: the scripts under scripts/, PEERS_DIR at peers/."""
    scripts, home = tmp_path / "scripts", tmp_path / "peers"
    files = {scripts / "vllm" / "serve.sh": False, scripts / "openvino" / "bench.py": False,
             home / "vllm-venv" / "bin" / "python": True,
             home / "model" / "smollm2-hf" / "config.json": False,
             home / "ov-venv" / "bin" / "python": True,
             home / "ov-model" / "int4" / "openvino_model.xml": False,
             home / "llama-tools-build" / "bin" / "llama-bench": True}
    for path, executable in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o755 if executable else 0o644)
    for var in ("VLLM_VENV", "VLLM_MODEL", "OV_VENV", "OV_MODELS", "LLAMACPP_BUILD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PEERS_DIR", str(home))
    monkeypatch.setenv("PEERS_SCRIPTS", str(scripts))
    return scripts, home


def test_compare_finds_installed_peers(compare, peers):
    scripts, home = peers
    assert compare.find_vllm("auto") == ((str(scripts / "vllm" / "serve.sh"),
                                          str(home / "model" / "smollm2-hf")), "")
    assert compare.find_openvino("auto", ["int4"]) == (str(scripts / "openvino" / "bench.py"), "")
    assert compare.find_llama_bench("auto") == (
        str(home / "llama-tools-build" / "bin" / "llama-bench"), "")


@pytest.mark.parametrize("remove,find,reason", [
    ("scripts/vllm/serve.sh", "vllm", "serve.sh (pass --vllm PATH/serve.sh, or set PEERS_SCRIPTS)"),
    ("peers/vllm-venv", "vllm", "not installed (no {peers}/vllm-venv/bin/python; run bash "
                                "{scripts}/vllm/setup.sh)"),
    ("peers/model", "vllm", "no model directory {peers}/model/smollm2-hf"),
    ("peers/ov-venv", "openvino", "not installed (no {peers}/ov-venv/bin/python; run bash "
                                  "{scripts}/openvino/setup.sh)"),
    ("peers/ov-model/int4", "openvino", "no int4 IR"),
    ("peers/llama-tools-build", "llama_bench", "not installed (no {peers}/llama-tools-build/bin/"
                                               "llama-bench; run bash {scripts}/llamacpp/setup.sh)"),
])
def test_compare_says_why_a_peer_is_left_out(compare, peers, remove, find, reason):
    import shutil

    scripts, home = peers
    target = home.parent / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    args = {"vllm": ("auto",), "openvino": ("auto", ["int4"]), "llama_bench": ("auto",)}[find]
    found, why = getattr(compare, f"find_{find}")(*args)
    assert found is None and reason.format(peers=home, scripts=scripts) in why


def test_compare_openvino_needs_the_ir_of_every_group(compare, peers):
    # bench.py's bf16 group runs the fp16-weight IR.
    found, why = compare.find_openvino("auto", ["int4", "bf16"])
    assert found is None and "no bf16 IR" in why and "ov-model/fp16/openvino_model.xml" in why


def test_compare_runs_no_peer_that_is_not_installed(compare, peers, monkeypatch, capsys):
    # --peers with nothing installed: one line each, then nothing to measure (no error before).
    class NoLlamaCpp:
        def __init__(self):
            raise ImportError("llama_cpp")

    _, home = peers
    for d in ("vllm-venv", "ov-venv", "llama-tools-build"):
        import shutil
        shutil.rmtree(home / d)
    monkeypatch.setattr(compare, "LlamaCpp", NoLlamaCpp)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--peers", "--formats", "",
                                      "--skip-transformers"])
    with pytest.raises(SystemExit) as e:
        compare.main()
    assert e.value.code == "compare.py: nothing to measure"
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[0] for ln in err[:3]] == ["vLLM left out", "OpenVINO left out",
                                                    "llama-bench left out"]
    assert all("not installed" in ln for ln in err[:3])


def test_compare_peers_flag_auto_detects_all_but_an_explicit_path(compare, peers, monkeypatch):
    scripts, _ = peers
    serve = str(scripts / "vllm" / "serve.sh")
    monkeypatch.setattr(sys, "argv", ["compare.py", "--peers", "--vllm", serve])
    args = compare.parse_args()
    assert (args.vllm, args.openvino, args.llama_bench) == (serve, "auto", "auto")
    monkeypatch.setattr(sys, "argv", ["compare.py", "--openvino", "--rounds", "2"])
    args = compare.parse_args()
    assert (args.vllm, args.openvino, args.llama_bench, args.rounds) == (None, "auto", None, 2)


@pytest.mark.parametrize("args,message", [
    (("--vllm", "/nonexistent/serve.sh"), "--vllm: /nonexistent/serve.sh: no such file"),
    (("--openvino", "/nonexistent/bench.py"), "--openvino: /nonexistent/bench.py: no such file"),
    (("--llama-bench", "/nonexistent/llama-bench"), "--llama-bench: /nonexistent/llama-bench: "
                                                    "no such file"),
    (("--openvino-groups", "int4,int3"), "--openvino-groups: unknown group 'int3' (int4, int8, "
                                         "bf16)"),
    (("--server-prompts", "0"), "argument --server-prompts: must be > 0"),
])
def test_compare_rejects_bad_peer_arguments(capsys, args, message):
    code, err = script_usage_error("compare.py", *args, capsys=capsys)
    assert code == 2 and message in err


def test_compare_takes_ratios_against_transformers_else_the_first_servelm_format(compare):
    fmts = ["servelm float32", "servelm float32/onednn"]
    assert compare.reference_row(["transformers float32"] + fmts, fmts) == "transformers float32"
    assert compare.reference_row(["transformers float32", "transformers bfloat16"] + fmts,
                                 fmts) == "transformers bfloat16"
    # --skip-transformers: the variants against the first format named
    assert compare.reference_row(fmts, fmts) == "servelm float32"
    assert compare.reference_row(fmts[:1], fmts[:1]) is None  # nothing to compare with


@pytest.mark.parametrize("args,message", [((), "the following arguments are required: --base"),
                                          (("--base", "HEAD", "--rounds", "0"), "--rounds"),
                                          (("--base", "no-such-rev"),
                                           "--base no-such-rev: not a revision"),
                                          (("--base", "HEAD", "--model", "/no/such.gguf"),
                                           "--model /no/such.gguf: no such file"),
                                          (("--base", "HEAD", "--quantization", "fp8"),
                                           "--quantization"),
                                          (("--base", "HEAD", "--kernel-tuning", "off"),
                                           "--kernel-tuning"),
                                          (("--base", "HEAD", "--dtype", "float16"),
                                           "--dtype"),
                                          (("--base", "HEAD", "--streams", "-1"),
                                           "--streams must be at least 1"),
                                          (("--base", "HEAD", "--ttft", "512,x"),
                                           "--ttft must be prompt lengths"),
                                          (("--base", "HEAD", "--ttft", "0"),
                                           "--ttft must be prompt lengths"),
                                          (("--base", "HEAD", "--without-amx", "--rounds", "0"),
                                           "--rounds must be at least 1")])
def test_startup_ab_rejects_bad_arguments(args, message, capsys):
    code, err = script_usage_error("startup_ab.py", *args, capsys=capsys)
    assert code == 2 and message in err


def test_compare_native_format_runs_the_file_as_it_is(compare):
    """--formats native: the model in its own format (no dtype or quantisation forced, so a
    quantised GGUF is not dequantised), named with what it resolved to."""
    native = compare.Servelm("native")
    engine = native.llm.engine
    assert engine.config.dtype == "auto"
    resolved = engine.config.quantization or str(engine.dtype).removeprefix("torch.")
    assert native.name == f"servelm native ({resolved})"
