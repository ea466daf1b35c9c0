"""LoRA adapters' cost, side by side in one process: an engine serving adapters against the
same model served alone (an engine without LoRA), the two taking turns step by step (each
engine's steps timed alone, in alternating order, so a slow spell of the machine falls on both).

    python benchmarks/lora_ab.py [--model PATH] [--adapters 8] [--rank 16] [--streams 64]
                                 [--output-len 64] [--rounds 3] [--json OUT]

- many streams: --streams prompts at once, spread round-robin over --adapters rank --rank
  adapters (every projection adapted), against the same prompts on the engine without
  LoRA: output tokens per second, and their ratio;
- one stream: one request with an adapter against the base engine's: TPOT (its engine steps
  after the prompt), and their ratio;
- memory: the bytes one resident adapter takes in the model's slots, against its own
  weights' bytes in the activation dtype.

The adapters are random PEFT-format directories written for the model's shapes (no peft
needed), A and B non-zero, in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from servelm import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, cfg, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for a model of config cfg (servelm's ModelConfig)."""
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(cfg.num_layers):
        for t in TARGETS:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            k, n = shapes[t]
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            sd[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) * k ** -0.5
            sd[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))


def interleaved(sides, out_len: int) -> list[list[float]]:
    """sides: (llm, prompts, loras) per engine. Each engine's requests added, then the engines'
    steps taken in turn (the order flipped each turn) until all are done; each step timed.
    Returns each side's step seconds, in order. Every step finds its engine's weights evicted
    by the other's: a one-stream step reads them from memory even where one engine alone
    would keep a small model in a large L3 (this Xeon's 300 MiB), so its TPOT is that of a
    cold cache, on both sides alike. (Turns of 16 steps, the first two not counted, kept the
    cache warm but spread the ratio 0.6-1.6x from run to run on this VM: the L3 is shared.)"""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for llm, prompts, loras in sides:
        for i, prompt in enumerate(prompts):
            lora = loras[i] if isinstance(loras, list) else loras
            llm.engine.add_request(None, prompt, params,
                                   **({"lora_request": lora} if lora is not None else {}))
    times: list[list[float]] = [[] for _ in sides]
    turn = 0
    while any(llm.engine.has_unfinished_requests() for llm, _, _ in sides):
        order = list(range(len(sides)))
        if turn % 2:
            order.reverse()
        for i in order:
            engine = sides[i][0].engine
            if engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                times[i].append(time.perf_counter() - t)
        turn += 1
    return times


def throughput(base: LLM, lora: LLM, prompts: list[str], out_len: int, loras) -> tuple[float, float]:
    """Output tokens per second of the base engine and of the LoRA engine (loras: one adapter
    per prompt), their steps interleaved."""
    tb, tl = interleaved([(base, prompts, None), (lora, prompts, loras)], out_len)
    return len(prompts) * out_len / sum(tb), len(prompts) * out_len / sum(tl)


def tpot(base: LLM, lora: LLM, prompt: str, out_len: int, adapter) -> tuple[float, float]:
    """One stream's median decode step (the steps after its prompt's) on each engine, the
    LoRA engine's with `adapter`, their steps interleaved."""
    tb, tl = interleaved([(base, [prompt], None), (lora, [prompt], adapter)], out_len)
    return statistics.median(tb[1:]), statistics.median(tl[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()

    base = LLM(args.model, max_num_seqs=args.streams)
    lora = LLM(args.model, max_num_seqs=args.streams, enable_lora=True,
               max_loras=args.adapters, max_lora_rank=args.rank)
    cfg = lora.engine.model_config
    tmp = tempfile.TemporaryDirectory()
    loras = []
    for i in range(args.adapters):
        d = Path(tmp.name) / f"a{i}"
        write_adapter(d, cfg, args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(d)))
        lora.engine.add_lora(loras[-1])
    prompts = [f"Request {i}: explain how a paged KV cache lets many users share memory."
               for i in range(args.streams)]
    spread = [loras[i % len(loras)] for i in range(args.streams)]
    one = prompts[0]
    # Warm-up: every adapter resident, every batch shape seen once.
    throughput(base, lora, prompts, 8, spread)
    tpot(base, lora, one, 8, loras[0])

    rows = []
    for r in range(args.rounds):
        row = {"round": r}
        row["base_tok_s"], row["lora_tok_s"] = throughput(base, lora, prompts, args.output_len, spread)
        b, l = tpot(base, lora, one, args.output_len, loras[0])
        row["base_tpot_ms"], row["lora_tpot_ms"] = b * 1e3, l * 1e3
        row["streams_ratio"] = row["lora_tok_s"] / row["base_tok_s"]
        row["tpot_ratio"] = row["lora_tpot_ms"] / row["base_tpot_ms"]
        rows.append(row)
        print(f"round {r}: {args.streams} streams over {args.adapters} adapters "
              f"{row['lora_tok_s']:.0f} tok/s vs base {row['base_tok_s']:.0f} "
              f"({row['streams_ratio']:.3f}x); one stream TPOT {row['lora_tpot_ms']:.2f} ms vs "
              f"{row['base_tpot_ms']:.2f} ({row['tpot_ratio']:.3f}x)", flush=True)
    mgr = lora.engine.lora
    dtype = lora.engine.dtype
    slot = mgr.slot_bytes()
    own = mgr.adapter(loras[0].lora_name).nbytes_in(dtype)
    summary = {
        "streams_ratio": statistics.median(r["streams_ratio"] for r in rows),
        "tpot_ratio": statistics.median(r["tpot_ratio"] for r in rows),
        "slot_bytes": slot, "adapter_bytes": own, "model": cfg.name_or_path
        if hasattr(cfg, "name_or_path") else args.model or "embedded",
        "weight_format": lora.engine.weight_format, "dtype": str(dtype)}
    print(f"median: many streams {summary['streams_ratio']:.3f}x the base's tok/s, one stream "
          f"{summary['tpot_ratio']:.3f}x its TPOT; a resident rank-{args.rank} adapter takes "
          f"{slot / 2**20:.2f} MiB in the slots, its weights {own / 2**20:.2f} MiB "
          f"({lora.engine.weight_format}, {dtype})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rounds": rows, **summary}, indent=2))
    tmp.cleanup()


if __name__ == "__main__":
    main()
