"""Int8 activations on CUDA by row count, on Llama-3-8B's layer shapes: w8a8's Triton form
(servelm.layers.w8a8.W8A8TritonLinear: the activations smoothed and quantised per block by
a kernel of their own, then int8 tensor-core dot products a block at a time) against what
each layer runs without it: cuBLAS on bf16 weights, and the int4 layer's own path
(tinygemm up to its rows, then the weight dequantised for a bf16 matmul). The activation
quantisation's own time is shown apart. Random weights with a calibration of random channel
maxima (a few outliers).

    python benchmarks/cuda_w8a8.py [--rows 16,64,256,512,2048]
"""

from __future__ import annotations

import argparse

import torch

from servelm import quantization as Q
from servelm.cli import int_list
from servelm.layers import w8a8
from servelm.tuning_cuda import cuda_time_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int_list, default=[16, 64, 256, 512, 2048])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    from servelm.kernels import triton_quant

    torch.manual_seed(0)
    print("µs a call (median of 20, CUDA events); ratio: w8a8 / the layer's own")
    print(f"{'layer':>8} {'rows':>5} {'bf16 cuBLAS':>12} {'int4 own':>9} {'w8a8':>8} "
          f"{'of it: quant':>13} {'vs bf16':>8} {'vs int4':>8} {'TOP/s':>6}")
    for name, (n, k) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        amax = torch.rand(k) + 0.5
        amax[torch.randperm(k)[:8]] *= 30
        w8a8.set_calibration(lin, amax.cuda(), 64 if name == "down" else 128)
        q4 = Q.quantize_linear(lin, "int4")
        fast = w8a8.W8A8TritonLinear(lin)
        for m in args.rows:
            x = ((torch.rand(m, k) * 2 - 1) * amax).to("cuda", torch.bfloat16)
            bf, i4, w = cuda_time_us(lin, x), cuda_time_us(q4, x), cuda_time_us(fast, x)
            quant = cuda_time_us(lambda t: triton_quant.w8a8_quantize(t, fast.inv_scale,
                                                                      fast.block), x)
            err = ((fast(x).float() - lin(x).float()).norm() / lin(x).float().norm()).item()
            print(f"{name:>8} {m:5d} {bf:12.1f} {i4:9.1f} {w:8.1f} {quant:13.1f} {w / bf:8.2f} "
                  f"{w / i4:8.2f} {2 * m * n * k / w / 1e6:6.0f}  (rel. error {err:.4f})",
                  flush=True)


if __name__ == "__main__":
    main()
