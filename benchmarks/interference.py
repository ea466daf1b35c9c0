"""Decode interference: 16 streams decoding while a 2,000-token prompt arrives.

    python benchmarks/interference.py [--chunk 128] [--dtype auto]

Three runs in one process, on the engine the server drives (LLMEngine): the 16 streams
alone (baseline); with the long prompt prefilled in one step (no chunking: the token
budget holds the whole prompt); and with chunked prefill (a budget of --chunk tokens per
step, decodes first). Inter-token latencies of the 16 streams come from the engine's
per-token timestamps.
"""

from __future__ import annotations

import argparse
import gc

from servelm import LLM, SamplingParams


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def run(dtype: str, budget: int, long_prompt: bool, streams: int,
        out_len: int) -> tuple[list[float], float | None]:
    """The streams' inter-token latencies, and the long prompt's time to first token."""
    llm = LLM(dtype=dtype, max_num_batched_tokens=budget, max_num_seqs=min(budget, 256))
    engine = llm.engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", f"Stream {i}: tell me a long story about the sea.", params)
    long_ids = tok.encode("The history of the world, told at length. " * 300)[:2000]
    ids = {f"s{i}" for i in range(streams)}
    steps = 0
    done = {}
    while engine.has_unfinished_requests():
        if long_prompt and steps == 20:  # the streams are well into decoding
            engine.add_request("long", None, SamplingParams(max_tokens=4),
                               prompt_token_ids=long_ids)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    itl = [x for rid, o in done.items() if rid in ids for x in o.metrics.inter_token_latencies[5:]]
    ttft = done["long"].metrics.ttft if "long" in done else None
    del llm, engine
    gc.collect()
    return itl, ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunk", type=int, default=128, help="token budget per step when chunked")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=96)
    args = ap.parse_args()
    runs = {
        "baseline (no long prompt)": run(args.dtype, 4096, False, args.streams, args.output_len),
        "long prompt, no chunking": run(args.dtype, 4096, True, args.streams, args.output_len),
        f"long prompt, chunks of {args.chunk}": run(args.dtype, args.chunk, True, args.streams,
                                                    args.output_len),
    }
    base = percentile(runs["baseline (no long prompt)"][0], 99)
    print(f"\n{args.streams} streams x {args.output_len} tokens; a 2,000-token prompt arrives "
          f"at step 20")
    print(f"{'run':<32}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'max ms':>10}{'p99 / base':>12}"
          f"{'long TTFT s':>13}")
    for name, (itl, ttft) in runs.items():
        p99 = percentile(itl, 99)
        print(f"{name:<32}{percentile(itl, 50) * 1e3:>12.1f}{p99 * 1e3:>12.1f}"
              f"{max(itl) * 1e3:>10.1f}{p99 / base:>11.2f}x"
              f"{'-' if ttft is None else f'{ttft:.2f}':>13}")


if __name__ == "__main__":
    main()
