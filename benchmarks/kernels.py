"""Micro-benchmark of the weight formats on all the embedded model's linear layers.

For fp32, bf16, int8 and int4 weights, our C++ kernels (servelm/kernels/csrc/quant.cpp,
through servelm.quantization) and oneDNN-prepacked weights (servelm.prepack) side by side
with the stock PyTorch ops (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`,
oneDNN bf16/fp32 `F.linear`):

- batch 1: ms per token for one pass over every linear layer (qkv, o, gate_up, down of
  every layer and the LM head) and the weight bytes streamed per second (GB/s);
- batch 64: tokens per second for 64 rows through the same layers (batched decode).

    .venv/bin/python benchmarks/kernels.py [--threads 2] [--repeats 20] [--sweep]

--sweep also times our int8/int4 kernels against the bf16 oneDNN linear at 1..128 rows
(which is how we know the kernels can serve prefill and batched decode too).

--methods compares linear methods (servelm.layers.linear_methods, what the tuner picks
from) on every layer of one weight format, a pass over all of them at each row count, the
methods interleaved round by round (the best round counts) so drift weighs on all alike:

    .venv/bin/python benchmarks/kernels.py --methods panels,q8act,qdot --format int4 \
        --dtype bfloat16 --rows 1,8,64,512

(`w8a8_256` among them: the w8a8 kernel's AVX-VNNI form, where AVX-512 VL builds it beside
the wide one.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from servelm import quantization as Q
from servelm.runtime import resolve_device
from servelm.models.loader import load_model, open_checkpoint
from servelm.prepack import PackedLinear, prepack_supported


def model_linears() -> list[torch.Tensor]:
    """The fp32 weight of every linear layer the quantiser swaps (fused as the model runs)."""
    ckpt = open_checkpoint(None)
    cfg = ckpt.config()
    model = load_model(ckpt, cfg, torch.float32, resolve_device("cpu"), max_positions=256)
    return [m.weight.detach().clone() for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in Q.TARGETS and isinstance(m, torch.nn.Linear)]


def stock_int4(w: torch.Tensor, group: int):
    """PyTorch's own int4 CPU format for w: (packed, qScaleAndZeros [K/G, N, 2] bf16)."""
    n = w.shape[0]
    q, s, m = Q.quantize_int4(w, group)
    qi = Q.unpack_int4(q, n).to(torch.int32)
    s = s.transpose(1, 2).reshape(-1, s.shape[1])[:n]  # tiles -> row-major [N, K/G]
    m = m.transpose(1, 2).reshape(-1, m.shape[1])[:n]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, 1)
    # ours: w = s q + m; theirs: w = s (q - 8) + zero.
    sz = torch.stack([s.float(), m.float() + 8 * s.float()], dim=-1).transpose(0, 1)
    return packed, sz.to(torch.bfloat16).contiguous()


def time_pass(fns, xs, repeats: int) -> float:
    """Median seconds of one pass calling fns[i](xs[i]) for every layer."""
    for f, x in zip(fns, xs):  # warm-up
        f(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f, x in zip(fns, xs):
            f(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def methods_table(ws, methods: list[str], fmt: str, act: torch.dtype, rows: list[int],
                  rounds: int, group: int) -> None:
    """ms per pass over every layer for each method at each row count, and each method's
    time against the first's (see the module docstring)."""
    from servelm.layers import linear_methods as lm

    def source(w):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        if fmt == "int4":
            return Q.Int4Linear.from_linear(lin, group)
        if fmt == "int8":
            return Q.Int8Linear.from_linear(lin)
        lin.weight = torch.nn.Parameter(w.to(getattr(torch, fmt)), requires_grad=False)
        return lin

    srcs = [source(w) for w in ws]
    if any(m.startswith("w8a8") for m in methods):  # a unit calibration on every layer: the
        for s in srcs:                               # speed does not depend on it
            setattr(s, lm.w8a8.AMAX, torch.ones(s.in_features))

    def w8a8_256(s):  # w8a8's 256-bit (AVX-VNNI) form, where it builds beside the wide one
        mod = lm.w8a8.W8A8Linear(s)
        op = torch.ops.servelm_w8a8.linear256
        return lambda x: op(x, mod.inv_scale, mod.weight, mod.weight_scale, mod.block,
                            mod.out_features, mod.bias)
    for m in methods:
        if m == "w8a8_256":
            if not (lm.applies("w8a8", srcs[0], act, True)
                    and hasattr(torch.ops.servelm_w8a8, "linear256")):
                raise SystemExit("w8a8's 256-bit form is not built beside the wide one here")
        elif not all(lm.applies(m, s, act, True) for s in srcs):
            raise SystemExit(f"method {m!r} does not run {fmt} weights with {act} activations here")
    built = {m: [w8a8_256(s) if m == "w8a8_256" else lm.build(m, s, act) for s in srcs]
             for m in methods}
    print(f"\n{fmt} weights, {str(act).removeprefix('torch.')} activations: ms per pass over "
          f"all {len(ws)} layers (best of {rounds} interleaved rounds); x: against {methods[0]}")
    print(f"{'rows':>6s}" + "".join(f"{m:>18s}" for m in methods))
    with torch.inference_mode():
        for r in rows:
            xs = [torch.randn(r, w.shape[1]).to(act) for w in ws]
            best = {m: float("inf") for m in methods}
            for _ in range(rounds):
                for m in methods:
                    best[m] = min(best[m], time_pass(built[m], xs, 1))
            base = best[methods[0]]
            print(f"{r:6d}" + "".join(f"{best[m] * 1e3:9.2f} ({base / best[m]:4.2f}x)"
                                      for m in methods), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=Q.DEFAULT_GROUP_SIZE)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--methods", default=None, metavar="M,M",
                    help="compare these linear methods instead (e.g. panels,q8act,qdot)")
    ap.add_argument("--format", default="int4", choices=("int4", "int8", "bfloat16", "float32"),
                    help="--methods: the weights' format")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="--methods: the activations' dtype")
    ap.add_argument("--rows", default="1,8,64,512", help="--methods: row counts")
    args = ap.parse_args()
    if args.methods:
        from servelm.layers.linear_methods import METHODS

        known = (*METHODS, "w8a8_256")
        bad = [m for m in args.methods.split(",") if m not in known]
        if bad:
            ap.error(f"--methods: unknown {', '.join(bad)}; one of {', '.join(known)}")
        try:
            rows = [int(r) for r in args.rows.split(",")]
        except ValueError:
            rows = []
        if not rows or min(rows) < 1:
            ap.error(f"--rows must be positive integers separated by commas, got {args.rows!r}")
    torch.set_num_threads(args.threads)
    kernels = Q.kernels_available()
    G = args.group_size
    ws = model_linears()
    nparams = sum(w.numel() for w in ws)
    print(f"{len(ws)} weight matrices, {nparams / 1e6:.1f} M weights, {args.threads} threads, "
          f"int4 group {G}, our kernels {'built' if kernels else 'UNAVAILABLE'}")
    if args.methods:
        methods_table(ws, args.methods.split(","), args.format, getattr(torch, args.dtype),
                      rows, max(3, args.repeats // 4), G)
        return

    def lin(w):
        return lambda x: F.linear(x, w)

    formats = {}  # name -> (bytes of weights, [fn per layer], activation dtype)
    formats["fp32 linear (oneDNN)"] = (
        sum(w.numel() * 4 for w in ws), [lin(w) for w in ws], torch.float32)
    wbf = [w.to(torch.bfloat16) for w in ws]
    formats["bf16 linear (oneDNN)"] = (
        sum(w.numel() * 2 for w in wbf), [lin(w) for w in wbf], torch.bfloat16)
    if prepack_supported(torch.bfloat16, "cpu"):
        def packed(w):
            m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            m.weight.data.copy_(w)
            return PackedLinear(m)
        formats["fp32 prepacked (oneDNN, servelm)"] = (
            sum(w.numel() * 4 for w in ws), [packed(w) for w in ws], torch.float32)
        formats["bf16 prepacked (oneDNN, servelm)"] = (
            sum(w.numel() * 2 for w in wbf), [packed(w) for w in wbf], torch.bfloat16)
    i8 = []
    for w in ws:
        q, s = Q.quantize_int8(w)
        i8.append(Q.Int8Linear(q, s))
    i8_bytes = sum(m.out_features * m.in_features + 4 * m.out_features for m in i8)
    i4 = []
    for w in ws:
        q, s, m = Q.quantize_int4(w, G)
        i4.append(Q.Int4Linear(q, s, m, G, w.shape[0]))
    i4_bytes = sum(m.out_features * m.in_features // 2 + 4 * m.out_features * m.in_features // G
                   for m in i4)
    s8 = [(m.int8_weight(), m.scales[: m.out_features].to(torch.bfloat16)) for m in i8]
    formats["int8 stock _weight_int8pack_mm"] = (
        i8_bytes, [lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in s8],
        torch.bfloat16)
    if kernels:
        formats["int8 servelm"] = (i8_bytes, i8, torch.bfloat16)
    s4 = [stock_int4(w, G) for w in ws]
    formats["int4 stock _weight_int4pack_mm_for_cpu"] = (
        sum(p.numel() + sz.numel() * 2 for p, sz in s4),
        [lambda x, p=p, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, G, sz)
         for p, sz in s4],
        torch.bfloat16)
    if kernels:
        formats["int4 servelm"] = (i4_bytes, i4, torch.bfloat16)

    print(f"\n{'format':40s} {'MB':>7s} {'b=1 ms/tok':>11s} {'GB/s':>6s} {'b=1 tok/s':>10s} "
          f"{'b=' + str(args.batch) + ' tok/s':>12s}")
    with torch.inference_mode():
        for name, (nbytes, fns, dt) in formats.items():
            x1 = [torch.randn(1, w.shape[1]).to(dt) for w in ws]
            xb = [torch.randn(args.batch, w.shape[1]).to(dt) for w in ws]
            t1 = time_pass(fns, x1, args.repeats)
            tb = time_pass(fns, xb, max(3, args.repeats // 4))
            print(f"{name:40s} {nbytes / 1e6:7.1f} {t1 * 1e3:11.2f} {nbytes / t1 / 1e9:6.1f} "
                  f"{1 / t1:10.0f} {args.batch / tb:12.0f}", flush=True)

        if args.sweep and kernels:
            print("\nrows: ms per pass over all layers, our kernels vs oneDNN bf16 linear")
            for rows in (1, 2, 4, 8, 16, 32, 64, 128):
                xs = [torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in ws]
                r = [time_pass(f, xs, max(3, args.repeats // 4))
                     for f in (i8, i4, [lin(w) for w in wbf])]
                print(f"  rows={rows:4d}  int8 {r[0] * 1e3:7.2f}  int4 {r[1] * 1e3:7.2f}  "
                      f"bf16 {r[2] * 1e3:7.2f}", flush=True)


if __name__ == "__main__":
    main()
