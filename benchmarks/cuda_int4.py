"""int4 and int8 matmuls on CUDA by row count, on Llama-3-8B's layer shapes: where each
quantised layer's switch between a few-row kernel and dequantise + dense matmul belongs.

int4: tinygemm (`aten._weight_int4pack_mm`, what Int4Linear runs up to CUDA_INT4_MAX_ROWS
rows) against dequantising the weight for a bf16 matmul, by the Triton kernel
(servelm.kernels.triton_quant, what it runs from there on) and by the PyTorch reference,
and a plain bf16 matmul. int8: the Triton matmul converting the int8 weight in registers
(triton_quant.int8_linear, what Int8Linear runs up to CUDA_INT8_MAX_ROWS rows) against the
weight converted in the matmul's input and scaled after (what it runs past them).
(`aten._weight_int8pack_mm` lost to both at every row count on an H200 and is not used.)

    python benchmarks/cuda_int4.py [--rows 1,8,16,32,64,128,256,512]
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
    ap.add_argument("--rows", type=int_list, default=[1, 8, 16, 32, 64, 128, 256, 512])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    from servelm.kernels import triton_quant

    torch.manual_seed(0)
    print(f"int4: tinygemm up to CUDA_INT4_MAX_ROWS = {Q.CUDA_INT4_MAX_ROWS} rows; int8: "
          f"Triton up to CUDA_INT8_MAX_ROWS = {Q.CUDA_INT8_MAX_ROWS}; ms a call, median of 5-20")
    print(f"{'layer':>8} {'rows':>5} {'tinygemm':>9} {'triton dq+mm':>13} {'torch dq+mm':>12} "
          f"{'int8 triton':>12} {'int8 cvt+mm':>12} {'bf16':>7}")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        q4 = Q.quantize_linear(lin, "int4")
        q8 = Q.quantize_linear(lin, "int8")
        if q4.tg_weight is None:
            sys.exit("tinygemm does not run here")
        w = lin.weight.detach()
        s8 = q8.scales.to(torch.bfloat16)

        def triton_dq(x):
            return F.linear(x, triton_quant.dequantize_int4(
                q4.qweight, q4.scales, q4.mins, q4.group_size, n, torch.bfloat16))

        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tg = cuda_ms(lambda: torch.ops.aten._weight_int4pack_mm(
                x, q4.tg_weight, q4.group_size, q4.tg_scales_zeros))
            tq = cuda_ms(lambda: triton_dq(x))
            dq = cuda_ms(lambda: F.linear(x, q4.dequantize(torch.bfloat16)), reps=5)
            i8 = cuda_ms(lambda: triton_quant.int8_linear(x, q8.qweight, q8.scales))
            c8 = cuda_ms(lambda: F.linear(x, q8.qweight.to(torch.bfloat16)) * s8)
            bf = cuda_ms(lambda: F.linear(x, w))
            print(f"{name:>8} {m:5d} {tg:9.3f} {tq:13.3f} {dq:12.3f} {i8:12.3f} {c8:12.3f} "
                  f"{bf:7.3f}", flush=True)


if __name__ == "__main__":
    main()
