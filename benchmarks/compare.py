"""servelm against transformers (and llama.cpp, when llama-cpp-python is installed or
--llama-bench names llama.cpp's llama-bench tool), side by side in one run, on the embedded
model or --model GGUF: the three figures of issue 5.

    python benchmarks/compare.py [--formats bfloat16,float32,int8,int4,int4@float32] [--skip-transformers]
                                 [--transformers-dtypes float32,bfloat16] [--model FILE.gguf]
                                 [--llama-bench PATH] [--no-batch]
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
over the round's measured bandwidth) and the bf16 matmul limit at 64 streams, and how close
each round came (utilisation, median over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from servelm.cli import positive
from servelm.models.loader import default_model_path

# "<fmt>/<variant>" runs the format with one code path forced or switched off, for
# side-by-side figures: the engine settings (KernelConfig fields) each variant sets.
VARIANTS = {"tiles": {"linear_method": "tiles"},      # every linear layer on servelm's tiles
            "onednn": {"linear_method": "onednn"},    # ... on oneDNN's prepacked matmuls
            "qdot": {"linear_method": "qdot"},        # ... int4/int8 on the AVX2 integer kernels
            "int4pack": {"linear_method": "int4pack"},  # ... int4 on PyTorch's int4pack
            "torch": {"linear_method": "torch"},      # ... on plain F.linear
            "untuned": {"kernel_tuning": "off"},      # the built-in defaults, nothing measured
            "unfused": {"fused_decode": False},       # no int4/int8/bf16 DecodeStack
            "smallpages": {"hugepages": False},       # weights and KV cache in 4 KB pages
            "eager": {"cpu_kernels": False}}          # the PyTorch reference throughout
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


def _timed_gen(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODEL: str | None = None  # --model: the GGUF every system loads (None: the embedded one)
BATCHED = True             # --no-batch: skip the 64-stream figure


def model_file() -> str:
    return MODEL or default_model_path()


class Servelm(System):
    def __init__(self, fmt: str):
        """fmt: a dtype or quantisation (with bf16 activations, or "<quant>@float32");
        "<fmt>/<variant>": the same with one code path forced or off (VARIANTS)."""
        from servelm import LLM, SamplingParams

        base, _, variant = fmt.partition("/")
        base, _, act = base.partition("@")  # int4@float32: fp32 activations (default bf16)
        dtype, quant = (base, None) if base in ("float32", "bfloat16") else (act or "bfloat16", base)
        kw = {"quantization": quant} if quant else {}
        kw.update(VARIANTS[variant] if variant else {})
        self.llm = LLM(model=MODEL, dtype=dtype, enable_prefix_caching=False, **kw)
        self.name = f"servelm {fmt}"
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


METRICS = ("ttft_512_s", "decode_1_tok_s", "decode_64_tok_s")


def measure_round(systems: list[System], rnd: int, repeats: int,
                  decode_repeats: int) -> dict[str, dict]:
    """One sample of every metric of every system, the order rotated by the round."""
    out = {}
    k = rnd % len(systems)
    for s in systems[k:] + systems[:k]:
        time.sleep(0.3)  # the previous runtime's idle threads stop spinning
        out[s.name] = {"ttft_512_s": s.ttft(repeats),
                       "decode_1_tok_s": statistics.median(s.decode_1() for _ in range(decode_repeats)),
                       "decode_64_tok_s": s.decode_64()}
    return out


def _spread(xs: list[float]) -> str:
    return f"[{min(xs):.2f}-{max(xs):.2f}]" if len(xs) > 1 else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bfloat16,float32,int8,int4",
                    help="servelm weight formats to run (dtype or quantisation; FMT/unpacked, "
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
                    help="bf16 matmul peak for the roofline (default: measured each round)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--model", default=None, metavar="FILE.gguf",
                    help="a GGUF every system loads (default: the embedded SmolLM2)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="llama.cpp's llama-bench binary: a column measured with it")
    ap.add_argument("--no-batch", action="store_true", help="skip the 64-stream figure")
    args = ap.parse_args()
    global MODEL, BATCHED
    MODEL, BATCHED = args.model, not args.no_batch
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if len(set(formats)) != len(formats):
        ap.error(f"--formats names a format twice: {args.formats!r}")
    for fmt in formats:  # every format checked before anything loads
        variant = fmt.partition("/")[2]
        if variant and variant not in VARIANTS:
            ap.error(f"unknown format variant {variant!r} in {fmt!r} "
                     f"(one of {', '.join(VARIANTS)})")

    hf_dtypes = [d.strip() for d in args.transformers_dtypes.split(",") if d.strip()]
    for d in hf_dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"--transformers-dtypes: unknown dtype {d!r} (float32, bfloat16, float16)")

    from servelm.roofline import measure_hardware

    systems: list[System] = []
    for fmt in formats:
        print(f"loading servelm {fmt} ...", file=sys.stderr)
        systems.append(Servelm(fmt))
    if not args.skip_transformers:
        for dtype in hf_dtypes:
            print(f"loading transformers {dtype} ...", file=sys.stderr)
            systems.append(Transformers(dtype))
    try:
        systems.append(LlamaCpp())
    except ImportError:
        print("llama-cpp-python not installed: llama.cpp left out", file=sys.stderr)
    if args.llama_bench:
        systems.append(LlamaBench(args.llama_bench))

    rounds = []
    for rnd in range(args.rounds):
        hw = measure_hardware("bfloat16", "cpu")
        bw = args.bandwidth * 1e9 if args.bandwidth else hw.bandwidth
        peak = args.flops * 1e12 if args.flops else hw.flops
        print(f"round {rnd + 1}/{args.rounds}: {bw / 1e9:.1f} GB/s read, "
              f"{peak / 1e12:.2f} TFLOP/s bf16 matmul, {torch.get_num_threads()} threads",
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

    def per_round(name: str, key: str) -> list[float]:
        return [r["results"][name][key] for r in rounds if r["results"][name].get(key) is not None]

    def med(name: str, key: str) -> float | None:
        xs = per_round(name, key)
        return statistics.median(xs) if xs else None

    print(f"\n{args.rounds} rounds; each figure the median over the rounds")
    print(f"{'':<34}{'TTFT 512':>10}{'decode x1':>12}{'decode x64':>12}"
          f"{'BW limit x1':>13}{'x1 / limit':>11}{'x64 / bf16 peak':>16}")
    for s in systems:
        dec64 = med(s.name, "decode_64_tok_s")
        line = (f"{s.name:<34}{med(s.name, 'ttft_512_s') * 1000:>8.0f}ms"
                f"{med(s.name, 'decode_1_tok_s'):>8.1f}tok/s"
                + (f"{dec64:>8.0f}tok/s" if dec64 else f"{'-':>12}"))
        if isinstance(s, Servelm):
            u64 = med(s.name, "decode_64_utilisation")
            line += (f"{med(s.name, 'decode_1_bandwidth_limit'):>9.0f}tok/s"
                     f"{med(s.name, 'decode_1_utilisation'):>11.0%}"
                     + (f"{u64:>16.0%}" if u64 is not None else f"{'-':>16}"))
        print(line)

    def ratios(a: str, b: str, key: str) -> list[float]:
        return [r["results"][a][key] / r["results"][b][key] for r in rounds
                if r["results"][a].get(key) and r["results"][b].get(key)]

    names = {s.name for s in systems}
    ref, cpp = "transformers bfloat16", LlamaCpp.name
    if ref not in names and "transformers float32" in names:
        ref = "transformers float32"
    print("\nratios within a round, median [range] over the rounds:")
    for s in systems:
        if not isinstance(s, Servelm):
            continue
        parts = []
        if ref in names:
            for label, key in (("TTFT", "ttft_512_s"), ("decode x1", "decode_1_tok_s"),
                               ("decode x64", "decode_64_tok_s")):
                xs = ratios(s.name, ref, key)
                if xs:  # none for decode x64 with --no-batch
                    parts.append(f"{label} x{statistics.median(xs):.2f} {_spread(xs)}")
        for peer in (cpp, LlamaBench.name):
            if peer in names:
                xs = ratios(s.name, peer, "decode_1_tok_s")
                ys = ratios(s.name, peer, "ttft_512_s")
                parts.append(f"vs {peer}: decode x1 x{statistics.median(xs):.2f} {_spread(xs)}"
                             f", TTFT x{statistics.median(ys):.2f} {_spread(ys)}")
        if parts:
            print(f"  {s.name:<22} " + "   ".join(parts)
                  + (f"   (TTFT, decode: against {ref})" if ref in names else ""))
    if args.json:
        summary = {s.name: {k: med(s.name, k) for k in METRICS} for s in systems}
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "median": summary}, f, indent=2)


if __name__ == "__main__":
    main()
