"""Model-runner speed on randomly initialised models of real shapes, against the roofline.

For machines that cannot carry the embedded model's file (the GPU machine receives at most
64 MiB of working tree): the model is built from a shape alone, its weights drawn at random
on the device, and servelm's own ModelRunner (paged KV pool, batch building, attention
path, LM head on the sampled rows only) runs a prompt and decode steps. Nothing but torch
is needed (no gguf, FastAPI or tokenizer); transformers only with --transformers.

    python benchmarks/synthetic.py --shape smollm2-135m --device cuda --dtype bfloat16
    python benchmarks/synthetic.py --shape llama3-8b --device cuda --quantization int4
    python benchmarks/synthetic.py --shape smollm2-135m --device cpu   # here, as a check

Reports, per shape: TTFT of a --prompt-token prompt (one forward, logits of its last
position), and decode tok/s at each --batch (every sequence holding --context tokens),
with the roofline's bound for each (weights and KV read at --bandwidth, matmuls at
--flops) and the fraction reached. On CUDA every timing synchronises the device, and each
decode batch is timed with captured CUDA graphs, eagerly, and eagerly with the gather +
SDPA attention in place of the Triton kernels (--modes), alternating, with the ratios
graphs / eager and eager / gather. --transformers times transformers' LlamaForCausalLM of
the same shape (random weights, --dtype) the same way: TTFT of the prompt, and decode tok/s
of B sequences of --context tokens generating --hf-tokens more (its prefill subtracted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from servelm.attention import get_backend
from servelm.cli import int_list, positive
from servelm.engine.model_runner import KVCache, ModelRunner, SeqInput
from servelm.models.config import ModelConfig
from servelm.models.loader import build_model
from servelm.tuning import finalize_linears
from servelm.roofline import quantized_bits_per_weight
from servelm.roofline import ModelShape

SHAPES = {
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama3-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
}


def build(shape: str, dtype: torch.dtype, device: torch.device, max_len: int,
          quantization: str | None):
    cfg = ModelConfig(**SHAPES[shape])
    model = build_model(cfg, dtype, device, max_len)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    finalize_linears(model.eval(), quantization)
    return cfg, model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs, after one warm-up."""
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def hf_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    """transformers' Llama of the same shape, random weights (for side-by-side figures)."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    hcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.max_position_embeddings,
                       rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device(device):
        model = HFLlama(hcfg).to(dtype).eval()
    return model


def hf_generate_time(model, ids: torch.Tensor, n: int, device: torch.device) -> float:
    def run():
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
    return timed(run, device, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds")
    ap.add_argument("--batch", default="1,64", type=int_list, help="comma-separated batch sizes")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", default=None,
                    help="decode paths to time, comma-separated: graphs, eager, gather (eager "
                         "with gather + SDPA attention instead of Triton's; graphs and gather "
                         "need CUDA; default: all three on CUDA, eager on CPU)")
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers' Llama of the same shape (random weights)")
    ap.add_argument("--hf-tokens", type=positive(int), default=32,
                    help="tokens transformers generates per decode measurement")
    ap.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                    help="for the roofline (default: H200's 4800 on CUDA, 30 on CPU)")
    ap.add_argument("--flops", type=float, default=None, metavar="TFLOP/s",
                    help="dense 16-bit matmul peak (default: H200's 990 on CUDA, 0.9 on CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    modes = (args.modes or ("graphs,eager,gather" if cuda else "eager")).split(",")
    for m in modes:
        if m not in ("graphs", "eager", "gather") or (m != "eager" and not cuda):
            ap.error(f"--modes: {m!r} is not a decode path here (graphs and gather need "
                     "CUDA; eager)")
    dtype = getattr(torch, args.dtype)
    bw = (args.bandwidth or (4800 if cuda else 30)) * 1e9
    peak = (args.flops or (990 if cuda else 0.9)) * 1e12
    batches = args.batch
    max_len = max(args.prompt, args.context) + 64
    block = 16
    cfg, model = build(args.shape, dtype, device, max_len, args.quantization)
    per_seq = -(-max_len // block)
    num_blocks = max(batches) * per_seq + per_seq
    kv = KVCache(cfg, num_blocks, block, dtype, device, spare_block=True)
    runners = {"eager": ModelRunner(model, kv, device)}
    if "graphs" in modes:
        runners["graphs"] = ModelRunner(model, kv, device, cuda_graphs=True,
                                        max_graph_batch=max(batches))
    if "gather" in modes:
        runners["gather"] = ModelRunner(model, kv, device)
        runners["gather"].attention = get_backend("reference")
    runner = runners["eager"]
    bits = torch.empty(0, dtype=dtype).element_size() * 8
    shape = ModelShape.from_config(cfg, weight_bits=quantized_bits_per_weight(
        args.quantization, dtype_bits=bits), kv_bits=bits)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"{args.shape} ({cfg.num_params / 1e9:.2f} B params), {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}, {name}; roofline at "
          f"{bw / 1e9:.0f} GB/s and {peak / 1e12:.1f} TFLOP/s; C++ kernels: {runner.use_kernels}; "
          f"attention backend: {runner.attention.name}",
          flush=True)

    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(max(batches) + 1)]

    prompt = SeqInput(ids(args.prompt), 0, tables[-1][: -(-args.prompt // block)], True)
    ttft = timed(lambda: runner.execute([prompt]), device, max(3, args.reps // 2))
    flops = shape.prefill_flops(args.prompt, args.prompt // 2)
    ideal = max(flops / peak, shape.weight_bytes_per_step / bw)
    print(f"TTFT, {args.prompt}-token prompt: {ttft * 1e3:9.2f} ms   roofline "
          f"{ideal * 1e3:8.2f} ms (compute-bound: {flops / peak >= shape.weight_bytes_per_step / bw})"
          f"   {ideal / ttft:6.1%} of it", flush=True)

    # Fill every decoding sequence's context once (chunks of the prompt size), then time
    # steps where each of B sequences computes one token at position --context.
    for b in range(max(batches)):
        for s in range(0, args.context, args.prompt):
            n = min(args.prompt, args.context - s)
            runner.execute([SeqInput(ids(n), s, tables[b][: -(-(s + n) // block)], False)])
    sync(device)
    decode: dict[tuple[str, int], float] = {}
    for B in batches:
        step = [SeqInput(ids(1), args.context, tables[b][: -(-(args.context + 1) // block)], True)
                for b in range(B)]
        read = shape.weight_bytes_per_step + B * args.context * shape.kv_bytes_per_token
        ideal = max(read / bw, B * shape.flops_per_token(args.context) / peak)
        # Each mode's first call (the warm-up) captures its graph; then the modes alternate.
        times: dict[str, list[float]] = {m: [] for m in modes}
        for m in modes:
            runners[m].execute(step)
        for _ in range(max(1, args.reps // 5)):
            for m in modes:
                times[m].append(timed(lambda: runners[m].execute(step), device, 5))
        for m in modes:
            t = statistics.median(times[m])
            decode[m, B] = B / t
            print(f"decode, batch {B:3d}, context {args.context}: {B / t:10.1f} tok/s "
                  f"({t * 1e3:7.2f} ms a step)   roofline {B / ideal:10.1f} tok/s   "
                  f"{ideal / t:6.1%} of it   [{m}]", flush=True)
        for a, b in (("graphs", "eager"), ("eager", "gather")):
            if a in modes and b in modes:
                print(f"decode, batch {B:3d}: {a} / {b} {decode[a, B] / decode[b, B]:.2f}x",
                      flush=True)
    if "graphs" in runners:
        print(f"CUDA graphs captured: {runners['graphs'].graphs.num_captured}", flush=True)

    if args.transformers:
        del runners, runner
        hf = hf_model(cfg, dtype, device)
        one = torch.tensor([ids(args.prompt)], device=device)
        hf_ttft = hf_generate_time(hf, one, 1, device)
        print(f"transformers {args.dtype}: TTFT, {args.prompt}-token prompt: {hf_ttft * 1e3:9.2f} ms"
              f"   servelm / transformers {ttft / hf_ttft:.2f}x", flush=True)
        best = modes[0]
        for B in batches:
            x = torch.tensor([ids(args.context) for _ in range(B)], device=device)
            t = (hf_generate_time(hf, x, args.hf_tokens + 1, device)
                 - hf_generate_time(hf, x, 1, device))
            rate = B * args.hf_tokens / t
            print(f"transformers {args.dtype}: decode, batch {B:3d}, context {args.context}: "
                  f"{rate:10.1f} tok/s   servelm ({best}) / transformers "
                  f"{decode[best, B] / rate:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
