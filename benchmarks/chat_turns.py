"""A chat's next turn with the prefix cache on and off, side by side in one process: two
engines of the same model, the sides alternating round by round.

    python benchmarks/chat_turns.py [--model PATH] [--prompt-len 1000] [--answer-len 32]
                                    [--new-len 64] [--rounds 4] [--dtype bfloat16]

A round, on each engine: turn 1 (a random --prompt-len-token prompt) timed to its first
token; its answer (--answer-len greedy tokens); then turn 2 (turn 1, the answer and
--new-len new tokens) timed to its first token, and the tokens the cache gave it. Each round
takes a prompt of its own, so nothing carries over between rounds. Reported: the medians,
and the cached engine's time over the other's.

On a model with linear-attention layers (Qwen3-Next, Qwen3.5) the cached engine keeps the
recurrent state at the end of turn 1's last full block (a state snapshot) and turn 2 starts
there; the uncached one computes the whole conversation again.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from servelm import LLM, SamplingParams
from servelm.cli import positive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--prompt-len", type=positive(int), default=1000)
    ap.add_argument("--answer-len", type=positive(int), default=32)
    ap.add_argument("--new-len", type=positive(int), default=64)
    ap.add_argument("--rounds", type=positive(int), default=4)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    total = args.prompt_len + args.answer_len + args.new_len + 1
    kw = dict(dtype=args.dtype, max_model_len=max(total, 256), max_num_seqs=4)
    engines = {"cache on": LLM(args.model, **kw),
               "cache off": LLM(args.model, enable_prefix_caching=False, **kw)}
    vocab = engines["cache on"].engine.model_config.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    answer = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)

    def timed(llm, ids, params):
        t = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out

    times: dict[str, dict[str, list[float]]] = {k: {"turn 1": [], "turn 2": []} for k in engines}
    for r in range(args.rounds):
        rng = random.Random(r)
        turn1 = [rng.randrange(vocab // 4, vocab) for _ in range(args.prompt_len)]
        new = [rng.randrange(vocab // 4, vocab) for _ in range(args.new_len)]
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in names:
            llm = engines[name]
            t1, _ = timed(llm, turn1, first)
            _, out = timed(llm, turn1, answer)
            t2, out2 = timed(llm, turn1 + list(out.outputs[0].token_ids) + new, first)
            times[name]["turn 1"].append(t1)
            times[name]["turn 2"].append(t2)
            print(f"round {r} {name}: turn 1 {t1 * 1e3:.0f} ms, turn 2 {t2 * 1e3:.0f} ms "
                  f"({out2.metrics.num_cached_tokens} tokens cached)", flush=True)
    for turn in ("turn 1", "turn 2"):
        on, off = (statistics.median(times[k][turn]) for k in engines)
        print(f"{turn}: cache on {on * 1e3:.0f} ms, off {off * 1e3:.0f} ms: "
              f"{on / off:.3f}x the time")


if __name__ == "__main__":
    main()
