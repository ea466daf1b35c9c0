"""Offline throughput: servelm's LLM.generate vs transformers' generate, side by side in one run.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128]

Every request produces exactly --output-len tokens (EOS ignored / banned), so the
figures are aggregate output tokens per second of wall time, including prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from servelm import LLM, SamplingParams
from servelm.models.loader import default_model_path

TOPICS = ["the sea", "a robot", "prime numbers", "the KV cache", "Paris", "a lost key",
          "autumn", "a chess game", "bread", "the moon", "a violin", "rain"]


def make_prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}, part {i}." + " Go on." * (i % 7)
            for i in range(n)]


def bench_servelm(prompts, output_len, dtype) -> dict:
    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = sorted(o.metrics.tpot for o in outs)
    ttft = sorted(o.metrics.ttft for o in outs)
    del llm
    return {"name": f"servelm {dtype} (batch {len(prompts)})", "seconds": dt,
            "output_tokens": n_out, "tok_per_s": n_out / dt,
            "ttft_p50_s": ttft[len(ttft) // 2], "tpot_p50_s": tpot[len(tpot) // 2]}


def bench_transformers(prompts, output_len, batch_size, dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
              pad_token_id=tok.pad_token_id or 2)
    with torch.inference_mode():
        model.generate(**tok(prompts[:1], return_tensors="pt"), max_new_tokens=4,
                       pad_token_id=kw["pad_token_id"])  # warm-up
        t = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), batch_size):
            enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            out = model.generate(**enc, **kw)
            n_out += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
        dt = time.perf_counter() - t
    return {"name": f"transformers {dtype} (batch {batch_size})", "seconds": dt,
            "output_tokens": n_out, "tok_per_s": n_out / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch1-prompts", type=int, default=4,
                    help="prompts for transformers at batch 1 (it is slow; tok/s is per token)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="servelm dtypes to run")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    prompts = make_prompts(args.num_prompts)
    results = [bench_servelm(prompts, args.output_len, d) for d in args.dtypes.split(",")]
    if not args.skip_transformers:
        results.append(bench_transformers(prompts[:args.hf_batch1_prompts], args.output_len, 1,
                                          "float32"))
        results.append(bench_transformers(prompts, args.output_len, args.hf_batch, "float32"))
    base = next((r for r in results if r["name"].startswith("transformers") and
                 f"batch {args.hf_batch})" in r["name"]), None)
    print(f"\n{args.num_prompts} prompts x {args.output_len} output tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'run':<34}{'tok/s':>10}{'seconds':>10}{'vs HF batch':>13}")
    for r in results:
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x" if base else "-"
        print(f"{r['name']:<34}{r['tok_per_s']:>10.1f}{r['seconds']:>10.1f}{ratio:>13}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
