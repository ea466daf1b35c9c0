"""Whole-row int8 activations, simulated in fp32: how far from the accuracy bar they are, with and
without SmoothQuant's migration of activation outliers into the weights, and how fast oneDNN's
int8 GEMM runs the model's shapes against the q8act kernel.

    python benchmarks/int8_accuracy.py [--model FILE.gguf] [--tokens 512] [--alphas 0.5,0.65,0.8]
                                       [--speed] [--rows 512]

A whole-row int8 matmul (one scale per activation row, one per weight output channel) is what
AMX-INT8 tiles, oneDNN's `torch._int_mm` and CUDA's int8 GEMMs accumulate in int32 without an
fp32 step per block; q8act's blocks of 32 need that step (docs/kernels.md, "q8act"). Each
variant below replaces every targeted linear layer of the model (transformers, the GGUF
dequantised to fp32) by its quantised form and reads, on the first --tokens tokens of
tests/data/prose.txt, the mean KL of the next-token distribution against the unquantised
model, the perplexity's change and the top-1 agreement:

- q8act-like: activations per block of 32, the weights as they are;
- per-token int8 activations and per-output-channel int8 weights, unsmoothed;
- the same after SmoothQuant: per input channel j, s_j = max|X_j|^a / max|W_j|^(1-a) with
  max|X_j| from one forward pass over a calibration text (docs/modules.md and README.md,
  not the evaluation text), X / s quantised per token and W * s per channel;
- each with the LM head, or down_proj and the LM head, left unquantised.

The bar (issue 57): KL <= 0.005 and perplexity within 1%. --speed also times, on this
machine, each distinct shape at --rows rows: `torch._int_mm` (int8 x int8 -> int32), the
per-token quantisation of x in PyTorch ops, q8act's int4 op and bf16 `F.linear`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# This script's folder holds kernels.py, which would shadow the `kernels` package that
# transformers looks for at import; nothing here imports a sibling.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def load(path: str | None):
    import transformers

    from servelm.models.paths import resolve_model_path

    gguf = Path(path) if path else Path(resolve_model_path(None))
    kw = dict(gguf_file=gguf.name)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    model.eval()
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == emb.weight.data_ptr():  # tied: quantising one must not touch the other
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    return tok, model


def q8_rows(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """x with each row (or each block of a row) rounded to int8 at scale max|x| / 127."""
    xb = x if block is None else x.reshape(*x.shape[:-1], -1, block)
    s = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / s.clamp_min(1e-30)) * s).reshape(x.shape)


def q8_channels(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / s.clamp_min(1e-30)) * s


class Simulation:
    def __init__(self, model, calib: torch.Tensor, evalu: torch.Tensor):
        self.model, self.evalu = model, evalu
        self.linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        self.head = model.get_output_embeddings()
        self.weights = {n: m.weight.detach().clone() for n, m in self.linears}
        self.amax: dict[str, torch.Tensor] = {}

        def seen(name):
            def hook(mod, args):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
                self.amax[name] = torch.maximum(self.amax.get(name, x), x)
            return hook

        hooks = [m.register_forward_pre_hook(seen(n)) for n, m in self.linears]
        with torch.no_grad():
            model(calib)
        for h in hooks:
            h.remove()
        self.ref = self.logprobs()

    def logprobs(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.model(self.evalu).logits[0].float(), -1)

    def run(self, alpha: float | None, block: int | None = None, quantise_weights: bool = True,
            keep: tuple[str, ...] = (), keep_head: bool = False) -> tuple[float, float, float]:
        hooks = []
        try:
            for n, m in self.linears:
                if any(k in n for k in keep) or (keep_head and m is self.head):
                    continue
                w = self.weights[n]
                s = torch.ones(w.shape[1])
                if alpha is not None:
                    wmax = w.abs().amax(0).clamp_min(1e-5)
                    s = (self.amax[n].clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)).clamp_min(1e-5)
                m.weight.data.copy_(q8_channels(w * s) if quantise_weights else w * s)
                hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, s=s: (q8_rows(args[0] / s, block),)))
            lp = self.logprobs()
        finally:
            for h in hooks:
                h.remove()
            for n, m in self.linears:
                m.weight.data.copy_(self.weights[n])
        ref = self.ref
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        target = self.evalu[0, 1:, None]
        nll = -lp[:-1].gather(1, target).mean().item()
        nll0 = -ref[:-1].gather(1, target).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        return kl, math.exp(nll - nll0) - 1, top1


def timed(f, n: int = 10) -> float:
    f()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def speed(model, rows: int) -> None:
    import torch.nn.functional as F

    from servelm.layers.q8act import Int4Q8Linear, available
    from servelm.quantization.surgery import quantize_linear

    shapes = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings():
            shapes.setdefault(tuple(m.weight.shape), m.weight.detach())
    print(f"\nus per call at {rows} rows ({torch.get_num_threads()} threads): "
          "_int_mm | quantise x (torch ops) | q8act int4 | bf16 F.linear")
    for (n_out, k), w in shapes.items():
        a = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (n_out, k), dtype=torch.int8).t()
        x = torch.randn(rows, k).bfloat16()
        wb = w.bfloat16()
        t_mm = timed(lambda: torch._int_mm(a, b))
        t_q = timed(lambda: q8_rows(x.float()).to(torch.int8))
        t_bf = timed(lambda: F.linear(x, wb))
        t_q8 = math.nan
        if available() and k % 32 == 0:
            lin = torch.nn.Linear(k, n_out, bias=False)
            lin.weight.data.copy_(w)
            q8 = Int4Q8Linear(quantize_linear(lin, "int4"))
            t_q8 = timed(lambda: q8(x))
        ops = 2 * rows * n_out * k
        print(f"  {n_out}x{k}: {t_mm:8.0f} ({ops / t_mm / 1e6:.2f} TOP/s) | {t_q:6.0f} | "
              f"{t_q8:8.0f} ({ops / t_q8 / 1e6:.2f}) | {t_bf:8.0f} ({ops / t_bf / 1e6:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--alphas", default="0.5,0.65,0.8")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    tok, model = load(args.model)
    evalu = tok((ROOT / "tests/data/prose.txt").read_text(), return_tensors="pt").input_ids
    calib_text = (ROOT / "docs/modules.md").read_text() + (ROOT / "README.md").read_text()
    calib = tok(calib_text, return_tensors="pt").input_ids[:, :args.tokens]
    sim = Simulation(model, calib, evalu[:, :args.tokens])
    alphas = [float(a) for a in args.alphas.split(",") if a]
    variants = [("q8act-like: blocks of 32, weights as they are",
                 dict(alpha=None, block=32, quantise_weights=False)),
                ("per token, unsmoothed", dict(alpha=None)),
                ("per token, unsmoothed, LM head kept", dict(alpha=None, keep_head=True))]
    for a in alphas:
        variants += [(f"per token, SmoothQuant a={a}, LM head kept", dict(alpha=a, keep_head=True)),
                     (f"per token, SmoothQuant a={a}, down_proj and LM head kept",
                      dict(alpha=a, keep=("down_proj",), keep_head=True))]
    print(f"{args.model or 'the embedded model'}: {len(sim.linears)} linear layers, "
          f"{sim.evalu.shape[1]} tokens of prose.txt")
    for name, kw in variants:
        kl, dppl, top1 = sim.run(**kw)
        print(f"  {name:58s} KL {kl:.4f}  perplexity {dppl * 100:+.2f}%  top-1 {top1 * 100:.1f}%",
              flush=True)
    if args.speed:
        speed(model, args.rows)


if __name__ == "__main__":
    main()
