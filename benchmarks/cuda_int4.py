"""int4 matmuls on CUDA by row count: tinygemm (`aten._weight_int4pack_mm`, what Int4Linear
runs up to CUDA_INT4_MAX_ROWS rows) against dequantising the weight for a bf16 matmul (what
it runs from there on) and a plain bf16 matmul, on Llama-3-8B's layer shapes; where the
switch between the first two belongs.

    python benchmarks/cuda_int4.py [--rows 1,16,64,128,256,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from servelm import quantization as Q
from servelm.cli import int_list

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def cuda_ms(fn, reps: int = 20) -> float:
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int_list, default=[1, 16, 64, 128, 256, 512])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    torch.manual_seed(0)
    print(f"{'layer':>8} {'rows':>5} {'tinygemm ms':>12} {'dequant+mm ms':>14} {'bf16 ms':>8}")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        q = Q.quantize_linear(lin, "int4")
        if q.tg_weight is None:
            sys.exit("tinygemm does not run here")
        w = lin.weight.detach()
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tg = cuda_ms(lambda: torch.ops.aten._weight_int4pack_mm(
                x, q.tg_weight, q.group_size, q.tg_scales_zeros))
            dq = cuda_ms(lambda: F.linear(x, q.dequantize(torch.bfloat16)))
            bf = cuda_ms(lambda: F.linear(x, w))
            print(f"{name:>8} {m:5d} {tg:12.3f} {dq:14.3f} {bf:8.3f}", flush=True)


if __name__ == "__main__":
    main()
