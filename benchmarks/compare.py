"""servelm against transformers (and llama.cpp, when llama-cpp-python is installed or
--llama-bench names llama.cpp's llama-bench tool), side by side in one run, on the embedded
model or --model GGUF: the three figures of issue 5. With --vllm, --openvino (or --peers for
both and llama-bench) also the peer engines that ../shared/peers sets up, each left out with
a one-line reason when it is not installed.

    python benchmarks/compare.py [--formats bfloat16,float32,int8,int4,int4@float32,native] [--skip-transformers]
                                 [--transformers-dtypes float32,bfloat16] [--model FILE.gguf]
                                 [--llama-bench [PATH]] [--no-batch]
                                 [--vllm [SERVE_SH]] [--server-prompts 128] [--long-prompt 4000]
                                 [--openvino [BENCH_PY]] [--openvino-groups int4] [--peers]
                                 [--rounds 3] [--repeats 5] [--decode-repeats 3]

- TTFT, 512-token prompt: one request alone, prefix caching off, median of --repeats.
- Decode, one stream: 1 / TPOT of a 128-token generation (prefill excluded), median of
  --decode-repeats.
- Decode, 64 streams: 64 sequences decoding together, tokens/s of the decode steps
  (64 / TPOT for servelm; for the others, the difference between generating 129 and 1
  tokens for the batch, so their prefill is excluded the same way).

Every system is loaded first; then each of --rounds rounds measures all of them in turn (the
order rotating from round to round) after probing the machine. A shared machine's speed
drifts by 10-30% from minute to minute, so each ratio is taken within a round (both sides
measured within a minute of each other) and the median of the rounds' ratios is reported,
with their range; each figure in the table is the median over the rounds.

Each servelm format also gets its roofline: decode bandwidth limit (weight bytes per step
over the round's measured bandwidth) and the matmul limit at 64 streams (the faster of bf16's
and fp32's peak), and how close
each round came (utilisation, median over the rounds).

Peers (locations from PEERS_DIR, default /tmp/servelm-peers, and the variables of
../shared/peers/README.md; the scripts from PEERS_SCRIPTS, default ../shared/peers beside
this checkout):

- --vllm: vLLM's OpenAI server (the peers' vllm/serve.sh) against `servelm serve`, both on
  the peers' HF directory in --server-dtype (bf16; float32 on a CPU without AVX512-BF16) and
  both measured with `servelm bench`, the same client. In each round each server in turn is
  started, waited for (/v1/models), measured and stopped with its whole process group, so
  only one holds the cores: TTFT of a 512-token prompt (p50 of --repeats), one stream's
  1/TPOT (128 tokens after 16, p50 of --decode-repeats) and output tok/s of
  --server-prompts 128-in/128-out requests at concurrency 64; also its start-up time and
  the group's RSS. --long-prompt N adds the TTFT of an N-token prompt (after one untimed).
- --openvino: the peers' openvino/bench.py driver, which measures servelm's LLM against
  OpenVINO GenAI in-process (each in its own process) in rounds of its own, after
  compare.py's rounds; its figures join the table and its ratios are taken within its rounds.
- --llama-bench with no PATH: the peers' build ($PEERS_DIR/llama-tools-build).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Iterator

import torch

# Run as a script, this directory leads sys.path, and its kernels.py then answers
# transformers' probe for the `kernels` package (find_spec), whose import then fails inside
# `from transformers import ...`. Nothing here imports a sibling module.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from servelm.bench.process import free_port, run_bench  # noqa: E402
from servelm.cli import positive
from servelm.config import LINEAR_METHODS
from servelm.models.loader import default_model_path

# "<fmt>/<variant>" runs the format with one code path forced or switched off, for
# side-by-side figures: the engine settings (KernelConfig fields) each variant sets.
VARIANTS = {**{m: {"linear_method": m}  # every linear layer on this method (linear_methods)
               for m in LINEAR_METHODS if m != "auto"},
            "untuned": {"kernel_tuning": "off"},      # the built-in defaults, nothing measured
            "unfused": {"fused_decode": False},       # no int4/int8/bf16 DecodeStack
            "smallpages": {"hugepages": False},       # weights and KV cache in 4 KB pages
            "eager": {"cpu_kernels": False},          # the PyTorch reference throughout
            "noint8act": {"int8_activations": "off"}}  # no w8a8 (int4: q8act's blocks)
PROMPT_LEN = 512
GEN = 128
BATCH = 64


def _prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n,), generator=g).tolist()


class System:
    """One system under test, loaded and warmed up: each call measures one sample."""
    name: str

    def ttft(self, repeats: int) -> float:
        """Median TTFT (s) of `repeats` 512-token prompts."""
        raise NotImplementedError

    def decode_1(self) -> float:
        """Tokens/s of one stream's 128-token generation."""
        raise NotImplementedError

    def decode_64(self) -> float | None:
        return None

    def measure(self, repeats: int, decode_repeats: int) -> dict:
        """One round's sample of every metric."""
        return {"ttft_512_s": self.ttft(repeats),
                "decode_1_tok_s": statistics.median(self.decode_1() for _ in range(decode_repeats)),
                "decode_64_tok_s": self.decode_64()}


def _timed_gen(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODEL: str | None = None  # --model: the GGUF every system loads (None: the embedded one)
BATCHED = True             # --no-batch: skip the 64-stream figure
LONG_PROMPT: int | None = None  # --long-prompt: the servers' TTFT of a prompt this long


def model_file() -> str:
    return MODEL or default_model_path()


class Servelm(System):
    def __init__(self, fmt: str):
        """fmt: a dtype or quantisation (with bf16 activations, or "<quant>@float32");
        "<fmt>/<variant>": the same with one code path forced or off (VARIANTS)."""
        from servelm import LLM, SamplingParams

        base, _, variant = fmt.partition("/")
        base, _, act = base.partition("@")  # int4@float32: fp32 activations (default bf16)
        if base == "native":  # the file's own format (a quantised GGUF as it is), dtype auto
            kw = {}
        else:
            dtype, quant = ((base, None) if base in ("float32", "bfloat16")
                            else (act or "bfloat16", base))
            kw = {"dtype": dtype, **({"quantization": quant} if quant else {})}
        kw.update(VARIANTS[variant] if variant else {})
        self.llm = LLM(model=MODEL, enable_prefix_caching=False, **kw)
        self.name = f"servelm {fmt}"
        if base == "native":
            engine = self.llm.engine
            resolved = engine.config.quantization or str(engine.dtype).removeprefix("torch.")
            self.name += f" ({resolved})"
        self.one = SamplingParams(temperature=0, max_tokens=1)
        self.gen = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
        self.llm.generate([_prompt_ids(PROMPT_LEN, 99)], self.one, use_tqdm=False)  # warm-up
        shape = self.llm.engine.shape
        self.weight_bytes_per_step = shape.weight_bytes_per_step
        self.flops_per_token = shape.flops_per_token(0)

    def ttft(self, repeats: int) -> float:
        outs = [self.llm.generate([_prompt_ids(PROMPT_LEN, r)], self.one, use_tqdm=False)[0]
                for r in range(repeats)]
        return statistics.median(o.metrics.ttft for o in outs)

    def decode_1(self) -> float:
        return 1 / self.llm.generate([_prompt_ids(16, 7)], self.gen, use_tqdm=False)[0].metrics.tpot

    def decode_64(self) -> float | None:
        if not BATCHED:
            return None
        outs = self.llm.generate([_prompt_ids(16, 100 + i) for i in range(BATCH)], self.gen,
                                 use_tqdm=False)
        return BATCH / statistics.median(o.metrics.tpot for o in outs)


class Transformers(System):
    def __init__(self, dtype: str):
        from transformers import AutoModelForCausalLM

        d, f = os.path.split(model_file())
        self.model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
        self.name = f"transformers {dtype}"
        self._gen(torch.tensor([_prompt_ids(PROMPT_LEN, 99)]), 1)  # warm-up

    def _gen(self, ids: torch.Tensor, n: int) -> float:
        with torch.inference_mode():
            return _timed_gen(lambda: self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0))

    def ttft(self, repeats: int) -> float:
        return statistics.median(self._gen(torch.tensor([_prompt_ids(PROMPT_LEN, r)]), 1)
                                 for r in range(repeats))

    def decode_1(self) -> float:
        short = torch.tensor([_prompt_ids(16, 7)])
        return GEN / (self._gen(short, GEN + 1) - self._gen(short, 1))

    def decode_64(self) -> float | None:
        if not BATCHED:
            return None
        batch = torch.tensor([_prompt_ids(16, 100 + i) for i in range(BATCH)])
        return BATCH * GEN / (self._gen(batch, GEN + 1) - self._gen(batch, 1))


class LlamaCpp(System):
    name = "llama.cpp (llama-cpp-python, Q4_1)"

    def __init__(self):
        from llama_cpp import Llama

        self.llm = Llama(model_path=model_file(), n_ctx=2048,
                         n_threads=torch.get_num_threads(), n_batch=512, verbose=False)
        self._timed(_prompt_ids(PROMPT_LEN, 99), 1)  # warm-up

    def _timed(self, ids: list[int], n: int) -> float:
        def run():
            self.llm.reset()
            self.llm.eval(ids)
            for _ in range(n - 1):
                self.llm.eval([self.llm.sample(temp=0.0)])
        return _timed_gen(run)

    def ttft(self, repeats: int) -> float:
        return statistics.median(self._timed(_prompt_ids(PROMPT_LEN, r), 1) for r in range(repeats))

    def decode_1(self) -> float:
        short = _prompt_ids(16, 7)
        return GEN / (self._timed(short, GEN + 1) - self._timed(short, 1))


class LlamaBench(System):
    """llama.cpp's own llama-bench on the same GGUF: pp512 (as a TTFT: 512 / its tok/s) and
    tg128 (one stream), one repetition a sample, all the machine's threads."""

    name = "llama.cpp (llama-bench)"

    def __init__(self, tool: str):
        self.tool = tool
        self._run(16, 16)  # warm-up (page cache, first-run costs)

    def _run(self, prompt: int, gen: int) -> list[dict]:
        out = subprocess.run([self.tool, "-m", model_file(), "-p", str(prompt), "-n", str(gen),
                              "-t", str(torch.get_num_threads()), "-r", "1", "-o", "json"],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out)

    def ttft(self, repeats: int) -> float:
        rows = self._run(PROMPT_LEN, 0)
        return PROMPT_LEN / next(r["avg_ts"] for r in rows if r["n_prompt"] == PROMPT_LEN)

    def decode_1(self) -> float:
        rows = self._run(0, GEN)
        return next(r["avg_ts"] for r in rows if r["n_gen"] == GEN)


# ------------------------------------------------------------------------------------- peers
# The engines ../shared/peers sets up (its README): found where its scripts put them, and left
# out with a one-line reason when they are not there.
SERVER_DTYPES = ("bfloat16", "float32")  # the peers' HF directory is bf16: vLLM's default
OPENVINO_GROUPS = ("int4", "int8", "bf16")  # bench.py's --group


def peers_dir() -> str:
    return os.environ.get("PEERS_DIR") or "/tmp/servelm-peers"


def peers_scripts() -> str:
    """The peers' scripts: $PEERS_SCRIPTS, else ../shared/peers beside this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("PEERS_SCRIPTS") or os.path.join(os.path.dirname(root), "shared", "peers")


def _venv_python(var: str, default: str) -> str:
    return os.path.join(os.environ.get(var) or os.path.join(peers_dir(), default), "bin", "python")


def find_vllm(serve_sh: str) -> tuple[tuple[str, str] | None, str]:
    """((serve.sh, the HF directory it serves), "") when vLLM is installed, else (None, why not).
    serve_sh: a path, or "auto" for the peers' own."""
    if serve_sh == "auto":
        serve_sh = os.path.join(peers_scripts(), "vllm", "serve.sh")
    setup = os.path.join(os.path.dirname(serve_sh), "setup.sh")
    model = os.environ.get("VLLM_MODEL") or os.path.join(peers_dir(), "model", "smollm2-hf")
    py = _venv_python("VLLM_VENV", "vllm-venv")
    if not os.path.isfile(serve_sh):
        return None, f"no {serve_sh} (pass --vllm PATH/serve.sh, or set PEERS_SCRIPTS)"
    if not os.access(py, os.X_OK):
        return None, f"not installed (no {py}; run bash {setup})"
    if not os.path.isfile(os.path.join(model, "config.json")):
        return None, f"no model directory {model} (run bash {setup}, or set VLLM_MODEL)"
    return (serve_sh, model), ""


def find_openvino(bench_py: str, groups: list[str]) -> tuple[str | None, str]:
    """(bench.py, "") when OpenVINO and the IRs of `groups` are installed, else (None, why not).
    bench_py: a path, or "auto" for the peers' own."""
    if bench_py == "auto":
        bench_py = os.path.join(peers_scripts(), "openvino", "bench.py")
    setup = os.path.join(os.path.dirname(bench_py), "setup.sh")
    models = os.environ.get("OV_MODELS") or os.path.join(peers_dir(), "ov-model")
    py = _venv_python("OV_VENV", "ov-venv")
    if not os.path.isfile(bench_py):
        return None, f"no {bench_py} (pass --openvino PATH/bench.py, or set PEERS_SCRIPTS)"
    if not os.access(py, os.X_OK):
        return None, f"not installed (no {py}; run bash {setup})"
    for g in groups:  # bench.py's bf16 group runs the fp16-weight IR
        ir = os.path.join(models, "fp16" if g == "bf16" else g, "openvino_model.xml")
        if not os.path.isfile(ir):
            return None, f"no {g} IR ({ir}; run bash {setup}, or set OV_MODELS)"
    return bench_py, ""


def find_llama_bench(tool: str) -> tuple[str | None, str]:
    """(llama-bench, "") when it is there, else (None, why not). tool: a path, or "auto" for
    the peers' build."""
    if tool == "auto":
        build = os.environ.get("LLAMACPP_BUILD") or os.path.join(peers_dir(), "llama-tools-build")
        tool = os.path.join(build, "bin", "llama-bench")
    if not os.access(tool, os.X_OK):
        return None, (f"not installed (no {tool}; run bash "
                      f"{os.path.join(peers_scripts(), 'llamacpp', 'setup.sh')})")
    return tool, ""


def _group_pids(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after "pid (comm)"
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(d))
    return pids


def _group_rss_gib(pgid: int) -> float:
    total = 0
    for pid in _group_pids(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**30


def _stop_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the server's whole process group (vLLM: API server, EngineCore and worker),
    SIGKILL to what is left after `grace` seconds; returns when none of it runs."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while proc.poll() is None or _group_pids(proc.pid):  # poll() reaps the leader
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        else:
            return
    raise RuntimeError(f"process group {proc.pid} still runs after SIGKILL")


def _log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: str) -> None:
    """Until GET url/v1/models answers 200 (loopback, no proxy); an error if the server exits
    first or takes longer than `timeout` seconds."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before it was "
                               f"ready; the end of {log}:\n{_log_tail(log)}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with opener.open(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s; the end of {log}:\n"
                       f"{_log_tail(log)}")


def servelm_bench(url: str, *flags: str) -> dict:
    """`servelm bench` against url (a process of its own, as from the command line): its
    summary. An error if it fails or any request does."""
    return run_bench(url, *flags, strict=True)


class HttpServer(System):
    """An OpenAI-compatible server, started for each round's sample and stopped with its
    process group after it, so only one server holds the cores at a time; measured with
    `servelm bench`, the same client and the same cases for every server."""

    def __init__(self, name: str, command: Callable[[int], list[str]], env: dict[str, str],
                 ready_timeout: float, prompts: int):
        self.name, self.command, self.env = name, command, env
        self.ready_timeout, self.prompts = ready_timeout, prompts

    @contextlib.contextmanager
    def serving(self) -> Iterator[tuple[str, int, float]]:
        """(url, process group, seconds to ready) of a freshly started server."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tempfile.NamedTemporaryFile(prefix="compare-server-", suffix=".log",
                                         delete=False) as log:
            t = time.perf_counter()
            proc = subprocess.Popen(self.command(port), env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, url, self.ready_timeout, log.name)
            yield url, proc.pid, time.perf_counter() - t
        finally:
            _stop_group(proc)
        os.unlink(log.name)  # kept when the server failed

    def measure(self, repeats: int, decode_repeats: int) -> dict:
        print(f"  starting {self.name} ...", file=sys.stderr, flush=True)
        with self.serving() as (url, pgid, ready_s):
            # Untimed: the first 512-token prompt and the first batch (vLLM compiles per shape).
            servelm_bench(url, "--concurrency", "4", "--num-prompts", "4", "--input-len",
                          str(PROMPT_LEN), "--output-len", "4", "--seed", "100")
            # Each case its own seed: both servers cache prefixes.
            ttft = servelm_bench(url, "--concurrency", "1", "--num-prompts", str(repeats),
                                 "--input-len", str(PROMPT_LEN), "--output-len", "1",
                                 "--seed", "101")
            one = servelm_bench(url, "--concurrency", "1", "--num-prompts", str(decode_repeats),
                                "--input-len", "16", "--output-len", str(GEN), "--seed", "102")
            c64 = (servelm_bench(url, "--concurrency", str(BATCH), "--num-prompts",
                                 str(self.prompts), "--input-len", "128", "--output-len",
                                 str(GEN), "--seed", "103") if BATCHED else None)
            long = None
            if LONG_PROMPT:  # after a first, untimed one (a server may compile per shape)
                servelm_bench(url, "--concurrency", "1", "--num-prompts", "1", "--input-len",
                              str(LONG_PROMPT), "--output-len", "1", "--seed", "104")
                long = servelm_bench(url, "--concurrency", "1", "--num-prompts",
                                     str(min(repeats, 2)), "--input-len", str(LONG_PROMPT),
                                     "--output-len", "1", "--seed", "105")
            rss = _group_rss_gib(pgid)
        return {"ttft_512_s": ttft["ttft_ms"]["p50"] / 1000,
                "decode_1_tok_s": 1000 / one["tpot_ms"]["p50"],
                "decode_64_tok_s": None,  # not the in-process figure: serve_64_tok_s
                "serve_64_tok_s": c64["output_throughput"] if c64 else None,
                "ttft_long_s": long["ttft_ms"]["p50"] / 1000 if long else None,
                "ready_s": ready_s, "rss_gib": rss}


def server_pair(serve_sh: str, model_dir: str, dtype: str, prompts: int) -> list[HttpServer]:
    """`servelm serve` and vLLM (serve.sh) on the same HF directory in the same dtype.
    servelm's C++ kernels are built here if they are not yet, so no server's start-up
    includes a compile."""
    subprocess.run([sys.executable, "-m", "servelm.kernels"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv, not ours
    env["PEERS_DIR"] = peers_dir()
    env["VLLM_MODEL"] = model_dir
    env.pop("VLLM_PIDFILE", None)
    # The roofline figures only scale /metrics' utilisation gauges; given, the server skips
    # probing the machine at start, which takes minutes where bf16 matmul has no fast path
    # (AVX2), and the start-up time is the engine's.
    servelm = HttpServer(
        f"servelm serve {dtype}",
        lambda port: [sys.executable, "-m", "servelm.cli", "serve", "--model", model_dir,
                      "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
                      "--roofline-bandwidth", "1", "--roofline-flops", "1"],
        dict(os.environ), ready_timeout=600, prompts=prompts)
    vllm = HttpServer(f"vLLM {dtype}",  # serve.sh's --dtype bfloat16 is overridden by the last
                      lambda port: ["bash", serve_sh, str(port), "--dtype", dtype],
                      env, ready_timeout=600, prompts=prompts)  # ~1 min of torch.compile a start
    return [servelm, vllm]


def run_openvino(bench_py: str, group: str, rounds: int, repeats: int,
                 decode_repeats: int) -> tuple[list[dict[str, dict]], list[str]]:
    """bench.py drive for one group: its rounds in compare.py's terms ({name: metrics} per
    round) and its systems' names, servelm's first. With --no-batch it runs 1 stream for
    its batched case, and that figure is dropped."""
    with tempfile.NamedTemporaryFile(prefix="compare-ov-", suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, bench_py, "drive", "--group", group, "--rounds", str(rounds),
           "--repeats", str(repeats), "--decode-repeats", str(decode_repeats),
           "--threads", str(torch.get_num_threads()), "--gen-len", str(GEN),
           "--batch", str(BATCH if BATCHED else 1), "--json", out]
    env = dict(os.environ, SERVELM_PY=sys.executable, PEERS_DIR=peers_dir())
    try:
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)  # its own table: progress
        with open(out) as f:
            doc = json.load(f)
    finally:
        os.unlink(out)

    def name(n: str) -> str:  # its servelm is not compare.py's: another process, own rounds
        return f"{n} (bench.py)" if n.startswith("servelm") else n

    converted = [{name(n): {"ttft_512_s": r["ttft_s"], "decode_1_tok_s": r["decode_1_tok_s"],
                            "decode_64_tok_s": r["decode_batch_tok_s"] if BATCHED else None}
                  for n, r in rnd["results"].items()} for rnd in doc["rounds"]]
    return converted, list(converted[0])


METRICS = ("ttft_512_s", "decode_1_tok_s", "decode_64_tok_s", "serve_64_tok_s", "ttft_long_s")


def measure_round(systems: list[System], rnd: int, repeats: int,
                  decode_repeats: int) -> dict[str, dict]:
    """One sample of every metric of every system, the order rotated by the round."""
    out = {}
    k = rnd % len(systems)
    for s in systems[k:] + systems[:k]:
        time.sleep(0.3)  # the previous runtime's idle threads stop spinning
        out[s.name] = s.measure(repeats, decode_repeats)
    return out


def _spread(xs: list[float]) -> str:
    return f"[{min(xs):.2f}-{max(xs):.2f}]" if len(xs) > 1 else ""


def _ratios(rounds: list[dict], a: str, b: str, key: str) -> list[float]:
    """a / b for key in each round that has both."""
    return [r["results"][a][key] / r["results"][b][key] for r in rounds
            if r["results"].get(a, {}).get(key) and r["results"].get(b, {}).get(key)]


def reference_row(rows: list[str], servelm_rows: list[str]) -> str | None:
    """What each servelm format's ratios are taken against: transformers (bf16, else fp32)
    when it ran, else the first servelm format when several ran (variants side by side)."""
    for ref in ("transformers bfloat16", "transformers float32"):
        if ref in rows:
            return ref
    return servelm_rows[0] if len(servelm_rows) > 1 else None


def _pair_line(rounds: list[dict], a: str, b: str, keys: tuple[tuple[str, str], ...]) -> str:
    parts = []
    for label, key in keys:
        xs = _ratios(rounds, a, b, key)
        if xs:
            parts.append(f"{label} x{statistics.median(xs):.2f} {_spread(xs)}")
    return f"  {a} / {b}: " + "   ".join(parts)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bfloat16,float32,int8,int4",
                    help="servelm weight formats to run (dtype or quantisation, or native: "
                         "the file's own, e.g. a Q4_K_M GGUF as int4; FMT/unpacked, "
                         "FMT/unfused, FMT/smallpages, FMT/onednn: with that optimisation off)")
    ap.add_argument("--repeats", type=positive(int), default=5,
                    help="TTFT runs per round (their median is the round's figure)")
    ap.add_argument("--decode-repeats", type=positive(int), default=3,
                    help="one-stream generations per round (their median is the round's figure)")
    ap.add_argument("--rounds", type=positive(int), default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--transformers-dtypes", default="float32,bfloat16",
                    help="which transformers baselines to load (comma-separated)")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                    help="memory bandwidth for the roofline (default: measured each round)")
    ap.add_argument("--flops", type=float, default=None, metavar="TFLOP/s",
                    help="matmul peak for the roofline (default: measured each round, the "
                         "faster of bf16 and fp32)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--model", default=None, metavar="FILE.gguf",
                    help="a GGUF every system loads (default: the embedded SmolLM2)")
    ap.add_argument("--llama-bench", nargs="?", const="auto", default=None, metavar="PATH",
                    help="llama.cpp's llama-bench binary: a column measured with it (no PATH: "
                         "the peers' build under $PEERS_DIR)")
    ap.add_argument("--no-batch", action="store_true", help="skip the 64-stream figure")
    ap.add_argument("--vllm", nargs="?", const="auto", default=None, metavar="SERVE_SH",
                    help="vLLM's OpenAI server (the peers' vllm/serve.sh; no path: found "
                         "under ../shared/peers) against `servelm serve` on the same HF "
                         "directory, both through `servelm bench`")
    ap.add_argument("--server-prompts", type=positive(int), default=128, metavar="N",
                    help="requests in the servers' concurrency-64 case (128 in / 128 out)")
    ap.add_argument("--long-prompt", type=positive(int), default=None, metavar="TOKENS",
                    help="the servers also measure the TTFT of a prompt this long (issue "
                         "17's 4,000 tokens: chunked prefill), median of min(2, --repeats)")
    ap.add_argument("--server-dtype", default="bfloat16", choices=SERVER_DTYPES,
                    help="dtype both servers run (float32 where the CPU has no AVX512-BF16: "
                         "bf16 matmuls fall back to a slow path there)")
    ap.add_argument("--openvino", nargs="?", const="auto", default=None, metavar="BENCH_PY",
                    help="OpenVINO GenAI through the peers' openvino/bench.py driver (no "
                         "path: found under ../shared/peers), after compare.py's rounds")
    ap.add_argument("--openvino-groups", default="int4", metavar="G,G",
                    help=f"bench.py groups to run ({', '.join(OPENVINO_GROUPS)})")
    ap.add_argument("--peers", action="store_true",
                    help="every installed peer: --vllm --openvino --llama-bench, found where "
                         "../shared/peers puts them")
    args = ap.parse_args()
    formats = args.formats
    args.formats = [f.strip() for f in formats.split(",") if f.strip()]
    if len(set(args.formats)) != len(args.formats):
        ap.error(f"--formats names a format twice: {formats!r}")
    for fmt in args.formats:  # every format checked before anything loads
        variant = fmt.partition("/")[2]
        if variant and variant not in VARIANTS:
            ap.error(f"unknown format variant {variant!r} in {fmt!r} "
                     f"(one of {', '.join(VARIANTS)})")
    args.transformers_dtypes = [d.strip() for d in args.transformers_dtypes.split(",")
                                if d.strip()]
    for d in args.transformers_dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"--transformers-dtypes: unknown dtype {d!r} (float32, bfloat16, float16)")
    args.openvino_groups = [g.strip() for g in args.openvino_groups.split(",") if g.strip()]
    for g in args.openvino_groups:
        if g not in OPENVINO_GROUPS:
            ap.error(f"--openvino-groups: unknown group {g!r} ({', '.join(OPENVINO_GROUPS)})")
    if not args.openvino_groups:
        ap.error("--openvino-groups: none given")
    if args.peers:
        for flag in ("vllm", "openvino", "llama_bench"):
            setattr(args, flag, getattr(args, flag) or "auto")
    for flag, value in (("--vllm", args.vllm), ("--openvino", args.openvino),
                        ("--llama-bench", args.llama_bench)):
        if value not in (None, "auto") and not os.path.isfile(value):
            ap.error(f"{flag}: {value}: no such file")
    return args


def find_peers(args) -> None:
    """Resolve --vllm, --openvino and --llama-bench to what is installed (None where a peer
    is not, with one line saying why)."""
    def skip(what: str, why: str) -> None:
        print(f"{what} left out: {why}", file=sys.stderr)

    if args.vllm:
        args.vllm, why = find_vllm(args.vllm)
        if why:
            skip("vLLM", why)
    if args.openvino:
        args.openvino, why = find_openvino(args.openvino, args.openvino_groups)
        if why:
            skip("OpenVINO", why)
    if args.llama_bench:
        args.llama_bench, why = find_llama_bench(args.llama_bench)
        if why:
            skip("llama-bench", why)


def main() -> None:
    args = parse_args()
    global MODEL, BATCHED, LONG_PROMPT
    MODEL, BATCHED, LONG_PROMPT = args.model, not args.no_batch, args.long_prompt
    find_peers(args)

    from servelm.roofline import measure_hardware

    systems: list[System] = []
    for fmt in args.formats:
        print(f"loading servelm {fmt} ...", file=sys.stderr)
        systems.append(Servelm(fmt))
    if not args.skip_transformers:
        for dtype in args.transformers_dtypes:
            print(f"loading transformers {dtype} ...", file=sys.stderr)
            systems.append(Transformers(dtype))
    try:
        systems.append(LlamaCpp())
    except ImportError:
        print("llama-cpp-python not installed: llama.cpp left out", file=sys.stderr)
    if args.llama_bench:
        systems.append(LlamaBench(args.llama_bench))
    servers: list[HttpServer] = []
    if args.vllm:
        servers = server_pair(*args.vllm, args.server_dtype, args.server_prompts)
        systems += servers
    if not systems and not args.openvino:
        sys.exit("compare.py: nothing to measure")

    # The machine is probed for servelm's rooflines only: with none, or both figures given,
    # nothing is measured (the bf16 matmul probe takes minutes on a CPU without AVX-512).
    probe = any(isinstance(s, Servelm) for s in systems) and not (args.bandwidth and args.flops)
    rounds = []
    for rnd in range(args.rounds if systems else 0):
        hw = measure_hardware("bfloat16", "cpu") if probe else None
        if hw and not args.flops:  # a CPU without bf16 arithmetic peaks in fp32
            f32 = measure_hardware("float32", "cpu").flops
            hw = dataclasses.replace(hw, flops=max(hw.flops, f32))
        bw = args.bandwidth * 1e9 if args.bandwidth else hw.bandwidth if hw else float("nan")
        peak = args.flops * 1e12 if args.flops else hw.flops if hw else float("nan")
        roof = (f"{bw / 1e9:.1f} GB/s read, {peak / 1e12:.2f} TFLOP/s matmul peak, "
                if bw == bw and peak == peak else "")  # not NaN
        print(f"round {rnd + 1}/{args.rounds}: {roof}{torch.get_num_threads()} threads",
              file=sys.stderr)
        res = measure_round(systems, rnd, args.repeats, args.decode_repeats)
        for s in systems:
            if isinstance(s, Servelm):
                r = res[s.name]
                r["decode_1_utilisation"] = r["decode_1_tok_s"] * s.weight_bytes_per_step / bw
                if r["decode_64_tok_s"] is not None:  # None with --no-batch
                    r["decode_64_utilisation"] = r["decode_64_tok_s"] * s.flops_per_token / peak
                r["decode_1_bandwidth_limit"] = bw / s.weight_bytes_per_step
        rounds.append({"bandwidth": bw, "flops": peak, "results": res})

    # OpenVINO: bench.py's own rounds, after these; its round i joins round i's results (its
    # ratios are taken between its own systems only, measured within its round).
    ov_pairs: list[tuple[str, str]] = []
    if args.openvino:
        rounds += [{"results": {}} for _ in range(args.rounds - len(rounds))]
        for group in args.openvino_groups:
            print(f"OpenVINO {group}: {args.openvino} drive --group {group} ...", file=sys.stderr)
            ov_rounds, names = run_openvino(args.openvino, group, args.rounds, args.repeats,
                                            args.decode_repeats)
            for r, o in zip(rounds, ov_rounds):
                r["results"].update(o)
            ov_pairs += [(names[0], n) for n in names[1:]]

    def med(name: str, key: str) -> float | None:
        xs = [r["results"][name][key] for r in rounds
              if r["results"].get(name, {}).get(key) is not None]
        return statistics.median(xs) if xs else None

    by_name = {s.name: s for s in systems}
    rows = [s.name for s in systems if not isinstance(s, HttpServer)]
    rows += [n for pair in ov_pairs for n in pair if n not in rows]
    print(f"\n{args.rounds} rounds; each figure the median over the rounds")
    if rows:
        print(f"{'':<34}{'TTFT 512':>10}{'decode x1':>12}{'decode x64':>12}"
              f"{'BW limit x1':>13}{'x1 / limit':>11}{'x64 / peak':>16}")
    for name in rows:
        dec64 = med(name, "decode_64_tok_s")
        line = (f"{name:<34}{med(name, 'ttft_512_s') * 1000:>8.0f}ms"
                f"{med(name, 'decode_1_tok_s'):>8.1f}tok/s"
                + (f"{dec64:>8.0f}tok/s" if dec64 else f"{'-':>12}"))
        if isinstance(by_name.get(name), Servelm):
            u64 = med(name, "decode_64_utilisation")
            line += (f"{med(name, 'decode_1_bandwidth_limit'):>9.0f}tok/s"
                     f"{med(name, 'decode_1_utilisation'):>11.0%}"
                     + (f"{u64:>16.0%}" if u64 is not None else f"{'-':>16}"))
        print(line)
    if servers:
        print(f"\nover HTTP, `servelm bench` against one server at a time "
              f"({args.vllm[1]}, {args.server_dtype}):")
        print(f"{'':<34}{'TTFT 512':>10}{'1/TPOT x1':>12}{'c64 128/128':>13}"
              f"{'ready':>8}{'RSS':>9}"
              + (f"{f'TTFT {LONG_PROMPT}':>12}" if LONG_PROMPT else ""))
        for s in servers:
            c64, long = med(s.name, "serve_64_tok_s"), med(s.name, "ttft_long_s")
            print(f"{s.name:<34}{med(s.name, 'ttft_512_s') * 1000:>8.0f}ms"
                  f"{med(s.name, 'decode_1_tok_s'):>8.1f}tok/s"
                  + (f"{c64:>9.0f}tok/s" if c64 else f"{'-':>13}")
                  + f"{med(s.name, 'ready_s'):>7.0f}s{med(s.name, 'rss_gib'):>6.1f}GiB"
                  + (f"{long * 1000:>10.0f}ms" if long else ""))

    names = set(rows)
    cpp = LlamaCpp.name
    ref = reference_row(rows, [s.name for s in systems if isinstance(s, Servelm)])
    print("\nratios within a round, median [range] over the rounds:")
    for s in systems:
        if not isinstance(s, Servelm) or s.name == ref:
            continue
        parts = []
        if ref in names:
            for label, key in (("TTFT", "ttft_512_s"), ("decode x1", "decode_1_tok_s"),
                               ("decode x64", "decode_64_tok_s")):
                xs = _ratios(rounds, s.name, ref, key)
                if xs:  # none for decode x64 with --no-batch
                    parts.append(f"{label} x{statistics.median(xs):.2f} {_spread(xs)}")
        for peer in (cpp, LlamaBench.name):
            if peer in names:
                xs = _ratios(rounds, s.name, peer, "decode_1_tok_s")
                ys = _ratios(rounds, s.name, peer, "ttft_512_s")
                parts.append(f"vs {peer}: decode x1 x{statistics.median(xs):.2f} {_spread(xs)}"
                             f", TTFT x{statistics.median(ys):.2f} {_spread(ys)}")
        if parts:
            print(f"  {s.name:<22} " + "   ".join(parts)
                  + (f"   (TTFT, decode: against {ref})" if ref in names else ""))
    if servers:
        print(_pair_line(rounds, servers[0].name, servers[1].name,
                         (("TTFT", "ttft_512_s"), ("1/TPOT x1", "decode_1_tok_s"),
                          ("c64 tok/s", "serve_64_tok_s"), ("ready", "ready_s"),
                          ("RSS", "rss_gib"), (f"TTFT {LONG_PROMPT}", "ttft_long_s"))))
    for a, b in ov_pairs:
        print(_pair_line(rounds, a, b, (("TTFT", "ttft_512_s"), ("decode x1", "decode_1_tok_s"),
                                        ("decode x64", "decode_64_tok_s"))))
    if args.json:
        summary = {n: {k: med(n, k) for k in METRICS} for n in rows + [s.name for s in servers]}
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "median": summary}, f, indent=2)


if __name__ == "__main__":
    main()
