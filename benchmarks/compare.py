"""servelm against transformers (and llama.cpp, when llama-cpp-python is installed), side by
side in one run, on the embedded model: the three figures of issue 5.

    python benchmarks/compare.py [--formats bfloat16,float32,int8,int4] [--skip-transformers]

- TTFT, 512-token prompt: one request alone, prefix caching off, median of --repeats.
- Decode, one stream: 1 / TPOT of a 128-token generation (prefill excluded).
- Decode, 64 streams: 64 sequences decoding together, tokens/s of the decode steps
  (64 / TPOT for servelm; for the others, the difference between generating 129 and 1
  tokens for the batch, so their prefill is excluded the same way).

Each servelm format also gets its roofline: decode bandwidth limit (weight bytes per step
over the measured bandwidth) and the bf16 matmul limit at 64 streams, and how close the
run came (utilisation). Absolute figures drift on shared machines: compare within a run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from unittest import mock

import torch

from servelm.models.loader import default_model_path

# "<fmt>/<variant>" runs the format with one optimisation switched off, for side-by-side
# figures: the switch each variant sets while the engine loads.
VARIANTS = {"unpacked": "SERVELM_NO_PREPACK",          # oneDNN weight prepacking
            "unfused": "SERVELM_NO_FUSED_DECODE",      # the int4/int8 DecodeStack
            "smallpages": "SERVELM_NO_HUGEPAGES"}      # huge pages for weights and KV cache
PROMPT_LEN = 512
GEN = 128
BATCH = 64


def _prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n,), generator=g).tolist()


def bench_servelm(fmt: str, repeats: int) -> dict:
    """fmt: a dtype or quantisation; "<fmt>/<variant>": the same with one optimisation off
    (VARIANTS)."""
    from servelm import LLM, SamplingParams

    base, _, variant = fmt.partition("/")
    if variant and variant not in VARIANTS:
        raise SystemExit(f"unknown format variant {variant!r} in {fmt!r} "
                         f"(one of {', '.join(VARIANTS)})")
    dtype, quant = (base, None) if base in ("float32", "bfloat16") else ("bfloat16", base)
    kw = {"quantization": quant} if quant else {}
    # The switch is read while the engine loads; the environment is restored afterwards.
    env = dict.fromkeys(VARIANTS.values(), "0")
    if variant:
        env[VARIANTS[variant]] = "1"
    with mock.patch.dict(os.environ, env):
        llm = LLM(dtype=dtype, enable_prefix_caching=False, **kw)
    one = SamplingParams(temperature=0, max_tokens=1)
    gen = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    llm.generate([_prompt_ids(PROMPT_LEN, 99)], one, use_tqdm=False)  # warm-up
    ttfts = []
    for r in range(repeats):
        out = llm.generate([_prompt_ids(PROMPT_LEN, r)], one, use_tqdm=False)[0]
        ttfts.append(out.metrics.ttft)
    out = llm.generate([_prompt_ids(16, 7)], gen, use_tqdm=False)[0]
    tpot1 = out.metrics.tpot
    outs = llm.generate([_prompt_ids(16, 100 + i) for i in range(BATCH)], gen, use_tqdm=False)
    tpot64 = statistics.median(o.metrics.tpot for o in outs)
    engine = llm.engine
    shape = engine.shape
    res = {"name": f"servelm {fmt}", "ttft_512_s": statistics.median(ttfts),
           "decode_1_tok_s": 1 / tpot1, "decode_64_tok_s": BATCH / tpot64,
           "weight_bytes_per_step": shape.weight_bytes_per_step,
           "flops_per_token": shape.flops_per_token(0)}
    del llm, engine
    gc.collect()
    return res


def bench_transformers(dtype: str, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()

    def gen(ids: torch.Tensor, n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    with torch.inference_mode():
        long = torch.tensor([_prompt_ids(PROMPT_LEN, 99)])
        gen(long, 1)  # warm-up
        ttft = statistics.median(gen(torch.tensor([_prompt_ids(PROMPT_LEN, r)]), 1)
                                 for r in range(repeats))
        short = torch.tensor([_prompt_ids(16, 7)])
        dec1 = GEN / (gen(short, GEN + 1) - gen(short, 1))
        batch = torch.tensor([_prompt_ids(16, 100 + i) for i in range(BATCH)])
        dec64 = BATCH * GEN / (gen(batch, GEN + 1) - gen(batch, 1))
    del model
    gc.collect()
    return {"name": f"transformers {dtype}", "ttft_512_s": ttft, "decode_1_tok_s": dec1,
            "decode_64_tok_s": dec64}


def bench_llama_cpp(repeats: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = torch.get_num_threads()
    llm = Llama(model_path=default_model_path(), n_ctx=2048, n_threads=threads,
                n_batch=512, verbose=False)

    def timed(ids: list[int], n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        for _ in range(n - 1):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        return time.perf_counter() - t

    timed(_prompt_ids(PROMPT_LEN, 99), 1)
    ttft = statistics.median(timed(_prompt_ids(PROMPT_LEN, r), 1) for r in range(repeats))
    short = _prompt_ids(16, 7)
    dec1 = GEN / (timed(short, GEN + 1) - timed(short, 1))
    return {"name": "llama.cpp (llama-cpp-python, Q4_1)", "ttft_512_s": ttft,
            "decode_1_tok_s": dec1, "decode_64_tok_s": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bfloat16,float32,int8,int4",
                    help="servelm weight formats to run (dtype or quantisation; FMT/unpacked, "
                         "FMT/unfused, FMT/smallpages: with that optimisation off)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                    help="memory bandwidth for the roofline (default: measured)")
    ap.add_argument("--flops", type=float, default=None, metavar="TFLOP/s",
                    help="bf16 matmul peak for the roofline (default: measured)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    from servelm.roofline import measure_hardware

    hw = measure_hardware("bfloat16", "cpu")
    bw = args.bandwidth * 1e9 if args.bandwidth else hw.bandwidth
    peak = args.flops * 1e12 if args.flops else hw.flops
    print(f"machine: {bw / 1e9:.1f} GB/s read, {peak / 1e12:.2f} TFLOP/s bf16 matmul, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    rows = []
    for fmt in args.formats.split(","):
        print(f"servelm {fmt} ...", file=sys.stderr)
        rows.append(bench_servelm(fmt.strip(), args.repeats))
    if not args.skip_transformers:
        for dtype in ("float32", "bfloat16"):
            print(f"transformers {dtype} ...", file=sys.stderr)
            rows.append(bench_transformers(dtype, args.repeats))
    cpp = bench_llama_cpp(args.repeats)
    if cpp:
        rows.append(cpp)
    else:
        print("llama-cpp-python not installed: llama.cpp left out", file=sys.stderr)

    ref = next((r for r in rows if r["name"] == "transformers bfloat16"), None)
    print(f"\n{'':<34}{'TTFT 512':>10}{'decode x1':>12}{'decode x64':>12}"
          f"{'BW limit x1':>13}{'x1 / limit':>11}{'x64 / bf16 peak':>16}")
    for r in rows:
        dec64 = r["decode_64_tok_s"]
        line = (f"{r['name']:<34}{r['ttft_512_s'] * 1000:>8.0f}ms"
                f"{r['decode_1_tok_s']:>8.1f}tok/s"
                + (f"{dec64:>8.0f}tok/s" if dec64 else f"{'-':>12}"))
        if "weight_bytes_per_step" in r:
            limit1 = bw / r["weight_bytes_per_step"]
            limit64 = peak / r["flops_per_token"]
            r["decode_1_bandwidth_limit"] = limit1
            r["decode_64_matmul_limit"] = limit64
            line += (f"{limit1:>9.0f}tok/s{r['decode_1_tok_s'] / limit1:>11.0%}"
                     f"{dec64 / limit64:>16.0%}")
        print(line)
    if ref:
        print(f"\nTTFT vs transformers bf16 (lower is better), decode vs transformers bf16:")
        for r in rows:
            if r["name"].startswith("servelm"):
                print(f"  {r['name']:<22} TTFT x{r['ttft_512_s'] / ref['ttft_512_s']:.2f}   "
                      f"decode x1 {r['decode_1_tok_s'] / ref['decode_1_tok_s']:.2f}x   "
                      f"decode x64 {r['decode_64_tok_s'] / ref['decode_64_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bw, "flops": peak, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
