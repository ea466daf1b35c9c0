"""Decode attention and decode step micro-benchmarks: C++ kernels vs the eager PyTorch path.

    .venv/bin/python benchmarks/attention.py                 # attention + engine, bf16
    .venv/bin/python benchmarks/attention.py --skip-engine   # attention only
    .venv/bin/python benchmarks/attention.py --engine-context 32 1000  # long contexts too
    .venv/bin/python benchmarks/attention.py --prefill       # prompt attention + TTFT only
    .venv/bin/python benchmarks/attention.py --prefill --dtype float32  # ... its TTFT in fp32

1. Decode attention for B streams x L-token contexts (SmolLM2 shape: 9 query heads, 3 KV
   heads, head dim 64, block size 16), one layer: `paged_decode_attention` (reads K/V in place
   through the block tables) vs the eager path (index_select gather of every block + padded
   SDPA), blocks scattered over the pool as a long-running server leaves them.
2. Engine decode throughput (tok/s) at batch 1 and 64 with and without kernels, in one run
   (the same engine; the runner's path flipped as cpu_kernels=False would set it).
3. Prompt attention, one layer, B sequences of a Q-token chunk after C cached tokens (best
   of many runs): each cpu backend's prompt path that runs here (`cpu`: the flash-style C++
   op reading K/V in place through the block tables; `cpu_sdpa`: PyTorch's CPU flash
   attention, groups under 512 keys left to the C++ op; `cpu_amx`: servelm's AMX tile
   kernel, bf16) and `paged_attention` (gather + padded SDPA, the eager path). The C++ op
   replaced gather + bmm + a fused causal softmax + bmm, which took 0.91 ms against its
   0.43 ms (bf16, 512 tokens) and TTFT 164 against 147 ms.
4. Engine time to first token for a --prompt-len-token prompt (512 by default; in --dtype,
   bf16 by default; median and best of 7, the modes interleaved): each cpu backend that runs
   here, and the eager path (as cpu_kernels=False).
5. `--options`: the model options the C++ attention runs beside the reference (a sliding
   window, gpt-oss's sinks, Gemma 2's soft-cap, Llama 4's chunks) and its widest heads
   (Gemma 4's 512 dims, DeepSeek's 576-dim latent rows), one layer in each family's shape: a --prompt-len-token prompt (2048 by default) and --streams decodes of
   that context, the C++ ops against the reference. With `--model PATH` (a checkpoint
   directory or GGUF): that model's TTFT and decode tok/s at 1 and --streams streams with
   the cpu backend and with the reference attention, alternating in one run.

    .venv/bin/python benchmarks/attention.py --options --streams 16
    .venv/bin/python benchmarks/attention.py --options --model model.gguf --prompt-len 2048
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from servelm.attention import CPU_PROMPT_PATHS, AttentionSpec, get_backend
from servelm.attention.metadata import build_group
from servelm.attention.reference import paged_attention
from servelm.engine.model_runner import SeqInput
from servelm.kernels import load_ops


def bench(fn, min_time=1.0, warmup=3):
    for _ in range(warmup):
        fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= min_time:
            return el / n


def attention(B: int, L: int, dtype: torch.dtype, bs: int = 16, kvh: int = 3, g: int = 3,
              d: int = 64) -> dict:
    per_seq = -(-L // bs)
    num_blocks = B * per_seq + 16
    k_cache = torch.randn(num_blocks, bs, kvh, d).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d).to(dtype)
    perm = torch.randperm(num_blocks)[:B * per_seq].view(B, per_seq)
    q = torch.randn(B, kvh * g, d).to(dtype)
    scale = d ** -0.5
    res = {}
    if load_ops("ops"):
        tables = perm.to(torch.int32).contiguous()
        lens = torch.full((B,), L, dtype=torch.int32)
        op = torch.ops.servelm_ops.paged_decode_attention
        res["kernel"] = bench(lambda: op(q, k_cache, v_cache, tables, lens, scale))
    # Eager path: one group (all the same length), built as the runner builds it.
    seqs = [SeqInput([0], L - 1, perm[b].tolist()) for b in range(B)]
    grp = build_group(seqs, 0, bs, g, torch.device("cpu"))
    res["gather+sdpa"] = bench(lambda: paged_attention(q, k_cache, v_cache, grp, scale))
    kv_bytes = 2 * B * L * kvh * d * k_cache.element_size()
    return {k: (v, kv_bytes / v / 1e9) for k, v in res.items()}


def best(fn, reps: int = 30, warmup: int = 3, max_time: float = 2.0) -> float:
    """Fastest of `reps` runs (fewer if they take more than max_time): other processes on a
    small machine only ever add time."""
    for _ in range(warmup):
        fn()
    t_best, t_end = float("inf"), time.perf_counter() + max_time
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        t_best = min(t_best, t1 - t0)
        if t1 > t_end:
            break
    return t_best


def prefill_attention(Q: int, C: int, dtype: torch.dtype, B: int = 1, bs: int = 16, kvh: int = 3,
                      g: int = 3, d: int = 64) -> dict:
    """One layer's prompt attention for B sequences of a Q-token chunk after C cached tokens."""
    per_seq = -(-(C + Q) // bs)
    num_blocks = B * per_seq + 16
    k_cache = torch.randn(num_blocks, bs, kvh, d).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d).to(dtype)
    perm = torch.randperm(num_blocks)[:B * per_seq].view(B, per_seq)
    q = torch.randn(B * Q, kvh * g, d).to(dtype)
    seqs = [SeqInput([0] * Q, C, perm[b].tolist()) for b in range(B)]
    grp = build_group(seqs, 0, bs, g, torch.device("cpu"))
    scale = d ** -0.5
    res = {}
    for name in _cpu_backends(dtype):
        fn = get_backend(name).prompt_attention
        res[name] = best(lambda: fn(q, k_cache, v_cache, grp, scale))
    res["sdpa"] = best(lambda: paged_attention(q, k_cache, v_cache, grp, scale), reps=10)
    return res


def _cpu_backends(dtype: torch.dtype) -> list[str]:
    """The cpu backends that run the benchmark's shape in `dtype` here."""
    spec = AttentionSpec(torch.device("cpu"), dtype, dtype, 9, 3, 64, 16)
    return [n for n in CPU_PROMPT_PATHS if get_backend(n).unsupported(spec) is None]


def prefill_table() -> None:
    print("\n# prompt attention, one layer (9 q heads / 3 KV heads, d=64, block 16), ms, best of 30")
    cases = [(1, 512, 0), (1, 128, 384), (4, 128, 0), (16, 128, 0), (64, 16, 0), (1, 128, 0),
             (1, 64, 448), (1, 17, 0), (1, 4, 100), (4, 8, 200), (1, 2048, 0), (1, 4000, 0)]
    cols = ("cpu", "cpu_sdpa", "cpu_amx", "sdpa")
    print(f"{'dtype':8} {'B':>2} {'Q':>4} {'ctx':>4} " + " ".join(f"{c:>9}" for c in cols))
    nan = float("nan")
    for dtype in (torch.bfloat16, torch.float32):
        for B, Q, C in cases:
            r = prefill_attention(Q, C, dtype, B=B)
            print(f"{str(dtype).split('.')[-1]:8} {B:2d} {Q:4d} {C:4d} "
                  + " ".join(f"{r.get(c, nan) * 1e3:9.3f}" for c in cols), flush=True)


def engine_ttft(prompt_len: int = 512, reps: int = 7, dtype: str = "bfloat16") -> None:
    """TTFT (ms, median and best of `reps` after a warm-up) of one prompt of token ids in
    `dtype`; the modes take turns within each repetition, so a disturbance hits them alike."""
    import statistics

    from servelm import LLM, SamplingParams
    llm = LLM(dtype=dtype, enable_prefix_caching=False, max_model_len=max(2048, prompt_len + 16))
    runner = llm.engine.executor.runner
    sp = SamplingParams(temperature=0, max_tokens=1)
    have, backend = runner.use_kernels, runner.attention
    modes = {f"kernels, {n} attention": (True, n)
             for n in (_cpu_backends(llm.engine.dtype) if have else [])}
    modes["eager (cpu_kernels off)"] = (False, "reference")
    print(f"\n# engine TTFT, {dtype} SmolLM2-135M, {prompt_len}-token prompt, ms over {reps} runs")
    times: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for i in range(reps + 1):
            prompt = [1 + (7 * i + j) % 40000 for j in range(prompt_len)]
            for name, (use, attn) in modes.items():
                runner.use_kernels, runner.attention = use, get_backend(attn)
                t0 = time.perf_counter()
                llm.generate([prompt], sp)
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
    finally:
        runner.use_kernels, runner.attention = have, backend
    print(f"{'mode':28} {'median':>8} {'best':>8}")
    for name, ts in times.items():
        print(f"{name:28} {statistics.median(ts) * 1e3:8.1f} {min(ts) * 1e3:8.1f}", flush=True)


def engine_decode(llm, batch: int, prompt_len: int, max_tokens: int = 64) -> float:
    """Decode tok/s of `batch` greedy streams after their prompts are in the cache."""
    from servelm import SamplingParams
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    base = list(range(1000, 1000 + prompt_len))
    for i in range(batch):
        eng.add_request(f"b{batch}-{prompt_len}-{i}-{time.monotonic_ns()}", [7 + i] + base[1:], sp)
    # Prefill (and the first token) first; then time only steps where every stream decodes.
    while True:
        outs = eng.step()
        if eng.scheduler.num_waiting == 0 and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running):
            break
    tokens, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        tokens += sum(1 for _ in outs)
    return tokens / (time.perf_counter() - t0)


# (name, q heads, KV heads, head dim, options): one layer of each family the options serve,
# and the widest heads the C++ ops take.
OPTION_LAYERS = [
    ("gpt-oss sliding: window 128 + sinks", 64, 8, 64, dict(window=128, sinks=True)),
    ("gpt-oss full: sinks", 64, 8, 64, dict(sinks=True)),
    ("Gemma 2 global: soft-cap 50", 8, 4, 256, dict(softcap=50.0)),
    ("Gemma 2 local: window 4096 + soft-cap", 8, 4, 256, dict(window=4096, softcap=50.0)),
    ("Gemma 3 local: window 512", 4, 1, 256, dict(window=512)),
    ("Llama 4 local: chunk 8192", 40, 8, 128, dict(chunk=8192)),
    ("Gemma 4 global: 512-dim heads", 8, 2, 512, {}),
    ("DeepSeek-V2-Lite latent: 16 x 576 dims", 16, 1, 576, {}),
]


def options_case(h: int, kvh: int, d: int, opts: dict, prompt_len: int, streams: int,
                 dtype: torch.dtype, bs: int = 16) -> dict[str, float]:
    """One layer with `opts`: a prompt_len-token prompt, and `streams` decodes each after
    prompt_len cached tokens, on the C++ ops and on the reference (seconds, best of runs)."""
    from servelm.attention.cpu import paged_prefill_attention

    g = torch.Generator().manual_seed(0)
    per_seq = -(-(prompt_len + 1) // bs)
    nb = streams * per_seq + 16
    k_cache, v_cache = (torch.randn(nb, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(nb, generator=g)[:streams * per_seq].view(streams, per_seq)
    sinks = torch.randn(h, generator=g) if opts.get("sinks") else None
    window, softcap, chunk = opts.get("window"), opts.get("softcap"), opts.get("chunk")
    scale = d ** -0.5
    res = {}
    q = torch.randn(prompt_len, h, d, generator=g).to(dtype)
    grp = build_group([SeqInput([0] * prompt_len, 0, perm[0].tolist())], 0, bs, h // kvh,
                      torch.device("cpu"))
    res["prompt cpu"] = best(lambda: paged_prefill_attention(
        q, k_cache, v_cache, grp, scale, window, None, softcap, sinks, chunk), reps=10)
    res["prompt reference"] = best(lambda: paged_attention(
        q, k_cache, v_cache, grp, scale, window, None, softcap, sinks, chunk), reps=5)
    qd = torch.randn(streams, h, d, generator=g).to(dtype)
    tables = perm.to(torch.int32).contiguous()
    lens = torch.full((streams,), prompt_len + 1, dtype=torch.int32)
    op = torch.ops.servelm_ops.paged_decode_attention
    res["decode cpu"] = best(lambda: op(qd, k_cache, v_cache, tables, lens, scale, window or 0,
                                        None, None, chunk or 0, softcap or 0.0, sinks))
    dgrp = build_group([SeqInput([0], prompt_len, perm[b].tolist()) for b in range(streams)], 0,
                       bs, h // kvh, torch.device("cpu"))
    res["decode reference"] = best(lambda: paged_attention(
        qd, k_cache, v_cache, dgrp, scale, window, None, softcap, sinks, chunk), reps=10)
    return res


def options_table(args) -> None:
    dtype = getattr(torch, args.dtype)
    print(f"\n# model options, one layer, {args.dtype}: a {args.prompt_len}-token prompt and "
          f"{args.streams} decodes after {args.prompt_len} tokens, ms (best of runs)")
    print(f"{'layer':40} {'prompt cpu':>10} {'reference':>10} {'ratio':>6}   "
          f"{'decode cpu':>10} {'reference':>10} {'ratio':>6}")
    for name, h, kvh, d, opts in OPTION_LAYERS:
        r = options_case(h, kvh, d, opts, args.prompt_len, args.streams, dtype)
        print(f"{name:40} {r['prompt cpu'] * 1e3:10.2f} {r['prompt reference'] * 1e3:10.2f} "
              f"{r['prompt reference'] / r['prompt cpu']:5.1f}x   {r['decode cpu'] * 1e3:10.3f} "
              f"{r['decode reference'] * 1e3:10.3f} {r['decode reference'] / r['decode cpu']:5.1f}x",
              flush=True)


def options_engine(args, reps: int = 5) -> None:
    """--model's TTFT (median of reps) and decode tok/s at 1 and --streams streams, the cpu
    backend and the reference attention taking turns on one engine."""
    import statistics

    from servelm import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=max(4096, args.prompt_len + 128))
    runner = llm.engine.executor.runner
    if runner.attention.name not in CPU_PROMPT_PATHS:
        print(f"\n{args.model}: the engine runs the {runner.attention.name} attention, not a "
              f"cpu backend: nothing to compare")
        return
    modes = {"cpu": runner.attention, "reference": get_backend("reference")}
    sp = SamplingParams(temperature=0, max_tokens=1)
    ttft: dict[str, list[float]] = {m: [] for m in modes}
    decode: dict[tuple[str, int], list[float]] = {}
    try:
        for i in range(reps + 1):
            prompt = [1 + (7 * i + j) % 30000 for j in range(args.prompt_len)]
            for m, backend in (modes.items() if i % 2 else reversed(modes.items())):
                runner.attention = backend
                t0 = time.perf_counter()
                llm.generate([prompt], sp, use_tqdm=False)
                if i:
                    ttft[m].append(time.perf_counter() - t0)
        for i in range(2):
            for m, backend in (modes.items() if i % 2 else reversed(modes.items())):
                runner.attention = backend
                for b in (1, args.streams):
                    decode.setdefault((m, b), []).append(
                        engine_decode(llm, b, args.prompt_len, max_tokens=16))
    finally:
        runner.attention = modes["cpu"]
    print(f"\n# {args.model}, {args.dtype}: TTFT of a {args.prompt_len}-token prompt (median of "
          f"{reps}), decode tok/s after it (best of 2), attention backends alternating")
    print(f"{'attention':10} {'TTFT ms':>8} {'x1 tok/s':>9} {f'x{args.streams} tok/s':>10}")
    for m in modes:
        print(f"{m:10} {statistics.median(ttft[m]) * 1e3:8.1f} {max(decode[(m, 1)]):9.1f} "
              f"{max(decode[(m, args.streams)]):10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--prefill", action="store_true",
                    help="only the prompt attention table and the engine TTFT")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                    help="the engine TTFT's dtype (--prefill, --options)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="--prefill: the engine TTFT's prompt length (512); --options: the "
                         "prompt and decode context (2048)")
    ap.add_argument("--options", action="store_true",
                    help="only the model options (windows, sinks, soft-caps, chunks): C++ "
                         "ops against the reference")
    ap.add_argument("--model", default=None,
                    help="--options: also this model's TTFT and decode, cpu vs reference")
    ap.add_argument("--engine-context", type=int, nargs="*", default=[32],
                    help="prompt lengths for the engine decode runs (e.g. 32 1000)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"threads={torch.get_num_threads()}  kernels={'yes' if load_ops('ops') else 'NO'}")

    if args.options:
        args.prompt_len = args.prompt_len or 2048
        if load_ops("ops"):
            options_table(args)
        if args.model:
            options_engine(args)
        return
    if args.prefill:
        prefill_table()
        engine_ttft(prompt_len=args.prompt_len or 512, dtype=args.dtype)
        return
    if not args.skip_attention:
        attention_table(args)
        prefill_table()
    if not args.skip_engine:
        engine_table(args)
        engine_ttft()


def attention_table(args) -> None:
    print(f"\n# decode attention, one layer, {args.streams} streams x {args.context} tokens "
          f"(9 q heads / 3 KV heads, d=64, block 16)")
    print(f"{'dtype':8} {'path':12} {'ms':>8} {'GB/s of KV':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        r = attention(args.streams, args.context, dtype)
        for k, (t, gbs) in r.items():
            print(f"{str(dtype).split('.')[-1]:8} {k:12} {t * 1e3:8.3f} {gbs:11.1f}")
    for B, L in ((1, 1000), (1, 100), (64, 100)):
        r = attention(B, L, torch.bfloat16)
        print("bf16 B=%d L=%d: " % (B, L) + "  ".join(f"{k} {t * 1e3:.3f} ms" for k, (t, _) in r.items()))


def engine_table(args) -> None:
    from servelm import LLM
    llm = LLM(dtype="bfloat16", kv_cache_memory=(5 << 29))
    runner = llm.engine.executor.runner
    have, backend = runner.use_kernels, runner.attention
    paths = (True, False) if have else (False,)

    def use_path(use: bool) -> None:  # the C++ kernels throughout, or the eager reference
        runner.use_kernels = use
        runner.attention = get_backend("cpu" if use else "reference")

    for use in paths:  # warm-up: first calls, allocator, kernel load
        use_path(use)
        engine_decode(llm, 64, 32, max_tokens=8)
    print(f"\n# engine decode, bf16 SmolLM2-135M, greedy, 64 new tokens per stream")
    print(f"{'batch':>5} {'prompt':>6} {'kernels tok/s':>14} {'eager tok/s':>12} "
          f"{'kernels ms/step':>16} {'eager ms/step':>14}")
    runs = [(B, L) for L in args.engine_context for B in ((1, 64) if L <= 128 else (64,))]
    for B, L in runs:
        got = {}
        for use in paths:
            use_path(use)
            got[use] = engine_decode(llm, B, L)
        runner.use_kernels, runner.attention = have, backend
        k, e = got.get(True, float("nan")), got[False]
        print(f"{B:5d} {L:6d} {k:14.1f} {e:12.1f} {B / k * 1e3:16.2f} {B / e * 1e3:14.2f}",
              flush=True)


if __name__ == "__main__":
    main()
