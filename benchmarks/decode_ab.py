"""Decode tok/s with one optimisation on and off, alternating run by run in one process.

This machine's speed drifts by 10-30% from minute to minute, so two separate benchmark runs
cannot resolve a few percent; here each pair of runs is back to back and the ratio of each
pair is reported (median, min, max), with each side's median tok/s.

    python benchmarks/decode_ab.py [--what stack|hugepages|hybrid] [--quantization int4|int8|none]
                                   [--linear-method tiles|q8act|amx] [--model PATH]
                                   [--streams 1,4,8,16] [--pairs 4] [--tokens 64]
                                   [--prompt-len 16] [--kernel-tuning off|cached|fresh]

- stack: the DecodeStack (all decoder layers of a decode-only step in one C++ call)
  against the per-op kernel path, toggled on one engine (`model.fused_decode`), every layer
  on one method the stack runs: servelm's tiles (int4, int8 or bf16 weights), q8act
  (int4; --linear-method q8act) or amx (bf16 on AMX-BF16 CPUs; --quantization none).
- hugepages: weights and KV cache in 2 MB huge pages against plain pages: two engines, the
  second loaded with hugepages=False.
- hybrid: a hybrid model's KV pool in block groups (its sliding layers' pages out of the
  window given back) against one block table for every layer: two engines, the second
  loaded with hybrid_kv_cache=False (--model a hybrid model, e.g. Gemma 3; --prompt-len
  past its window to decode where the groups differ).
"""

from __future__ import annotations

import argparse
import os
import statistics

from servelm import LLM, SamplingParams
from servelm.cli import int_list, positive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("stack", "hugepages", "hybrid"), default="stack")
    ap.add_argument("--quantization", choices=("int4", "int8", "none"), default="int4",
                    help="none: the bf16 weights")
    ap.add_argument("--linear-method", choices=("tiles", "q8act", "amx"), default="tiles",
                    help="stack: the method every layer runs (q8act: int4 only; amx: bf16, "
                         "or int4 / int8 dequantised)")
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the "
                    "embedded model)")
    ap.add_argument("--streams", type=int_list, default=[1, 4, 8, 16])
    ap.add_argument("--pairs", type=positive(int), default=4)
    ap.add_argument("--tokens", type=positive(int), default=64)
    ap.add_argument("--prompt-len", type=positive(int), default=16)
    ap.add_argument("--kernel-tuning", choices=("off", "cached", "fresh"), default="cached",
                    help="hugepages: how both engines choose their linear methods (off: the "
                         "untuned defaults, no measuring at start-up)")
    args = ap.parse_args()

    quant = None if args.quantization == "none" else args.quantization
    if args.linear_method == "q8act" and quant != "int4":
        ap.error("--linear-method q8act runs int4 weights: add --quantization int4")
    if args.linear_method == "amx" and quant is not None:
        ap.error("--linear-method amx runs bf16 weights: add --quantization none")
    kw = dict(model=args.model, dtype="bfloat16", quantization=quant,
              enable_prefix_caching=False, kernel_tuning=args.kernel_tuning)
    if args.what == "stack":
        llm = LLM(linear_method=args.linear_method, **kw)
        if not llm.engine.executor.model.fused_decode:
            raise SystemExit("the DecodeStack is not bound here (needs the C++ kernels' "
                             "AVX512-BF16 tiles, and a model it implements)")
        engines = {"stack": llm, "per-op": llm}
        from servelm.tuning import linear_summary

        print(linear_summary(llm.engine.executor.model))
    elif args.what == "hybrid":
        groups, one = LLM(**kw), LLM(hybrid_kv_cache=False, **kw)
        if groups.engine.executor.kv_groups is None:
            raise SystemExit("not a hybrid model (sliding-window and full-attention "
                             "layers): no block groups to compare")
        engines = {"block groups": groups, "one table": one}
    else:
        huge, plain = LLM(**kw), LLM(hugepages=False, **kw)
        engines = {"huge pages": huge, "plain pages": plain}
    on, off = engines
    gen = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run(name: str, n: int) -> float:
        llm = engines[name]
        if args.what == "stack":
            llm.engine.executor.model.fused_decode = name == "stack"
        outs = llm.generate([list(range(1000 + i, 1000 + i + args.prompt_len))
                             for i in range(n)], gen, use_tqdm=False)
        return n / statistics.median(o.metrics.tpot for o in outs)

    print(f"{args.quantization}, {on} against {off}, {args.pairs} pairs per row "
          f"(alternating which goes first)")
    for n in args.streams:
        res = {on: [], off: []}
        for p in range(args.pairs):
            for name in ((on, off) if p % 2 == 0 else (off, on)):
                res[name].append(run(name, n))
        ratios = [a / b for a, b in zip(res[on], res[off])]
        print(f"streams {n:3d}: {on} {statistics.median(res[on]):8.1f} tok/s, "
              f"{off} {statistics.median(res[off]):8.1f} tok/s, ratio median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.what == "stack":
        engines["stack"].engine.executor.model.fused_decode = True


if __name__ == "__main__":
    main()
