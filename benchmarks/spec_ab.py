"""Speculative decoding on and off, alternating run by run in one process (one engine).

This machine's speed drifts by 10-30% from minute to minute and other agents load it, so
each pair of runs is back to back (the order alternating) and each pair's ratio is reported
(median, min, max), with each side's median tok/s. Speculation is toggled on the one engine
(`speculator.enabled`), so both sides share weights, kernels and KV pool.

    python benchmarks/spec_ab.py [--k 4] [--lookup 1,3] [--pairs 4] [--tokens 128]
                                 [--streams 1,64] [--dtype float32] [--model PATH]
                                 [--draft-model PATH] [--quantization int4]

Prompt lookup (ngram) by default; with --draft-model a smaller model with the target's
tokenizer drafts (method draft_model), e.g. Qwen2.5-Coder-0.5B for --model
Qwen2.5-Coder-1.5B (`scripts/fetch_models.py --all`).

Cases: a code edit (a function in the prompt, "rename X to Y"), a repeat-the-text chat (one
stream each: decode tok/s, from the first token to the last), and the same prompts over many
streams (output tok/s of the whole batch). Acceptance rate and mean accepted length are
those of the speculating runs of each case. At many streams the roofline turns speculation
off for steps already compute-bound, so "on" there measures what it costs to have it enabled.
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelm import LLM, SamplingParams
from servelm.cli import int_list, positive

CODE = '''def compute_invoice_total(line_items, discount_rate, tax_rate):
    subtotal = 0.0
    for line_item in line_items:
        line_total = line_item.unit_price * line_item.quantity
        if line_item.is_taxable:
            line_total = line_total * (1.0 + tax_rate)
        subtotal += line_total
    discount = subtotal * discount_rate
    total = subtotal - discount
    return round(total, 2)
'''
CASES = {
    "code edit": "Rewrite this Python function with the variable subtotal renamed to "
                 "running_sum. Output only the code.\n\n" + CODE,
    "repeat chat": "Repeat the following text exactly, word for word:\n\nThe KV cache keeps "
                   "the keys and values of every token a sequence has processed, in blocks of "
                   "sixteen tokens, so that each decode step only computes the newest token. "
                   "When the pool is full, the scheduler waits or preempts a request.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=positive(int), default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int_list, default=None,
                    help="prompt_lookup_min,max (ngram; default 1,3)")
    ap.add_argument("--model", default=None, help="the target (default: the embedded model)")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="speculate with this draft model (method draft_model), not ngram")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="weight-only quantisation of the target (and the draft)")
    ap.add_argument("--pairs", type=positive(int), default=4)
    ap.add_argument("--tokens", type=positive(int), default=128, help="max_tokens")
    ap.add_argument("--streams", type=int_list, default=[1, 64])
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.draft_model is not None:
        if args.lookup is not None:
            ap.error("--lookup is for prompt lookup (ngram), not --draft-model")
        spec = {"method": "draft_model", "model": args.draft_model,
                "num_speculative_tokens": args.k}
        what = f"draft model {args.draft_model}, k={args.k}"
    else:
        lookup = args.lookup or [1, 3]
        if len(lookup) != 2:
            ap.error("--lookup takes two numbers: min,max")
        spec = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
        what = f"ngram k={args.k}, lookup {lookup[0]}..{lookup[1]}"

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              speculative_config=spec)
    eng = llm.engine
    sp = eng.speculator
    tok = llm.get_tokenizer()
    prompts = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                        add_generation_prompt=True),
                                add_special_tokens=False)
               for name, text in CASES.items()}
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    cost = (f"; a draft forward costs {sp.draft_cost:.2f} of a target step"
            if args.draft_model else "")
    print(f"{what}, {args.dtype}{' ' + args.quantization if args.quantization else ''}; the "
          f"roofline's ridge here: {sp.ridge_tokens:.1f} tokens per weight read "
          f"({eng.hardware.bandwidth / 1e9:.1f} GB/s, {eng.hardware.flops / 1e9:.0f} GFLOP/s)"
          f"{cost}; {args.pairs} pairs per row, alternating which goes first")

    def run(on: bool, ids_list: list[list[int]]) -> tuple[float, int]:
        sp.enabled = on
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in ids_list], params,
                            use_tqdm=False)
        wall = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        if len(ids_list) == 1:  # one stream: decode tok/s, first token to last
            m = outs[0].outputs[0].metrics
            return (n - 1) / (m.last_token_time - m.first_token_time), n
        return n / wall, n

    run(True, [prompts["code edit"]])  # warm-up: the first steps of each shape
    run(False, [prompts["code edit"]])
    for streams in args.streams:
        cases = list(prompts) if streams == 1 else ["mixed"]
        for case in cases:
            ids = ([prompts[case]] if streams == 1 else
                   [prompts[list(prompts)[i % len(prompts)]] for i in range(streams)])
            res: dict[bool, list[float]] = {True: [], False: []}
            s0 = (eng.stats.num_spec_draft_tokens, eng.stats.num_spec_accepted_tokens,
                  eng.stats.num_spec_verifications)
            tokens = set()
            for p in range(args.pairs):
                for on in ((True, False) if p % 2 == 0 else (False, True)):
                    rate, n = run(on, ids)
                    res[on].append(rate)
                    tokens.add(n)
            d = eng.stats.num_spec_draft_tokens - s0[0]
            a = eng.stats.num_spec_accepted_tokens - s0[1]
            v = eng.stats.num_spec_verifications - s0[2]
            ratios = [x / y for x, y in zip(res[True], res[False])]
            acc = f"acceptance {a / d:.0%}, mean accepted length {1 + a / v:.2f}" if d else \
                "no drafts (the roofline kept speculation off)"
            print(f"{case:>12} x{streams:<3}: on {statistics.median(res[True]):7.1f} tok/s, "
                  f"off {statistics.median(res[False]):7.1f} tok/s, ratio median "
                  f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max "
                  f"{max(ratios):.2f}); {acc}; output tokens {sorted(tokens)}")


if __name__ == "__main__":
    main()
