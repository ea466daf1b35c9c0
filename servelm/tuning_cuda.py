"""Int8 activations on CUDA: which calibrated layers run w8a8's Triton form, and from which
row bucket, measured once at start-up.

On the CPU the tuner (servelm.tuning) times w8a8 beside the other linear methods. CUDA keeps
each layer's own kernel (cuBLAS for plain weights, tinygemm or the Triton int8 matmul for
quantised ones), and this is the one choice made there (`finalize`, after
servelm.tuning.finalize_linears): for each distinct shape of the layers calibration reached
(servelm.engine.calibration), the layer's own module and `W8A8TritonLinear` are timed at the
row buckets from w8a8's first (a batch's rows and a prompt's: one or a few rows are
memory-bound, where the layer's own kernel reads fewer bytes or as few), and where w8a8 is
faster by the tuner's margin the layers become a `BucketedLinear` running it there. A form
that fails to compile, or fails the tuner's known-answer check on the timed rows (against
the fp32 product, on inputs scaled by the calibration: servelm.tuning), is never taken. The int8 copies of the weights come out of the same
budget as the CPU's dequantised copies (KernelConfig.dequantized_copy_bytes; by default a
quarter of the GPU's free memory), the shapes that save the most time per byte first.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Callable

import torch
from torch import nn

from servelm.layers import linear_methods as lm
from servelm.layers import w8a8
from servelm.tuning import (ShapeChoice, TuningReport, _linear_layers, _shape_key, check_input,
                            choose, known_answer)

logger = logging.getLogger(__name__)

FIRST_BUCKET = lm.by_name("w8a8").first_bucket
REPEATS = 20  # timed calls a module and bucket (after two warm-up calls), the median kept


def cuda_time_us(mod: nn.Module, x: torch.Tensor, repeats: int = REPEATS) -> float:
    """The median µs of a call of mod(x) on x's CUDA device, timed by CUDA events."""
    for _ in range(2):
        mod(x)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mod(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def copy_bytes(src: nn.Module) -> int:
    """What W8A8TritonLinear adds for this layer: its int8 weights and their fp32 scales."""
    n, k = src.out_features, src.in_features
    return n * k + 4 * n * (k // max(w8a8.layer_block(src), 1)) + 4 * k


def default_budget(device: torch.device) -> int:
    """A quarter of the device's free memory now."""
    free, _ = torch.cuda.mem_get_info(device)
    return free // 4


def finalize(model: nn.Module, kernels, calibrate: Callable[[nn.Module], object],
             device: torch.device | None = None):
    """On CUDA, after servelm.tuning.finalize_linears (the weights quantised): the caller's
    calibrate (servelm.engine.calibration: the layers it reaches), then apply. Returns the
    TuningReport of the shapes timed (none elsewhere than CUDA). An optimisation: where the
    calibration pass fails, the engine starts without it (a warning says why). device: the
    model's (the tests name another)."""
    p = next(model.parameters(), None)
    device = device or (p.device if p is not None else None)
    if p is None or device.type != "cuda":
        return TuningReport([])
    t0 = time.perf_counter()
    try:
        calibrate(model)
    except Exception as e:  # noqa: BLE001 - int8 activations are optional
        logger.warning("int8 activations on CUDA: the calibration pass failed (%s: %s); "
                       "every layer keeps its own kernel", type(e).__name__, e)
        for layer in model.modules():
            if w8a8.calibrated(layer) is not None:
                delattr(layer, w8a8.AMAX)
        return TuningReport([])
    budget = (kernels.dequantized_copy_bytes if kernels.dequantized_copy_bytes is not None
              else default_budget(device))
    shapes = apply(model, p.dtype, device, budget)
    return TuningReport(shapes, time.perf_counter() - t0, source="measured" if shapes else "off")


@torch.no_grad()
def apply(model: nn.Module, act: torch.dtype, device: torch.device, budget: int,
          timer: Callable[[nn.Module, torch.Tensor], float] = cuda_time_us) -> list:
    """Times and swaps in w8a8 for the model's calibrated layers where it is faster (see
    the module's head); returns a ShapeChoice per shape timed (timer: µs a call of a module
    on an input, injectable for tests)."""
    groups: dict[str, list[tuple[str, nn.Module, str, nn.Module]]] = {}
    for item in _linear_layers(model):
        if w8a8.triton_applies(item[3], act, device):
            groups.setdefault(_shape_key(item[3], act), []).append(item)
    n = len(lm.BUCKET_ROWS)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes, saving = [], {}
    for key, items in groups.items():
        src = items[0][3]
        own, fast = [math.inf] * n, [math.inf] * n
        failed = []
        try:
            mod = w8a8.W8A8TritonLinear(src)
            ref = lm.reference_weight(src)
            for b in range(FIRST_BUCKET, n):
                x = check_input(src, lm.BUCKET_ROWS[b], gen, act).to(device)
                if not known_answer(mod, ref, src.bias, x):
                    raise ValueError("it failed its known-answer check")
                own[b], fast[b] = timer(src, x), timer(mod, x)
        except Exception as e:  # a kernel that does not compile or computes wrongly here
            logger.warning("int8 activations on CUDA: %s stays on its own kernel: w8a8 %s",
                           key, e)
            failed, fast = ["w8a8"], [math.inf] * n
        mod = None
        times = {"torch": own, "w8a8": fast}
        shape = ShapeChoice(key, [it[0] for it in items], choose(times, "torch"), times, failed)
        shapes.append(shape)
        gain = sum(own[b] - fast[b] for b in range(n) if shape.methods[b] == "w8a8")
        if gain > 0:
            saving[key] = gain / copy_bytes(src)
    left = budget
    for key in sorted(saving, key=saving.get, reverse=True):
        items = groups[key]
        need = sum(copy_bytes(it[3]) for it in items)
        shape = next(s for s in shapes if s.key == key)
        if need > left:
            logger.info("int8 activations on CUDA: %s stays on its own kernel (its int8 copies, "
                        "%d MiB, are over the copies' budget)", key, need >> 20)
            shape.methods = ["torch"] * n
            continue
        left -= need
        for qname, parent, name, src in items:
            fast = w8a8.W8A8TritonLinear(src)
            setattr(parent, name, lm.BucketedLinear(
                [fast if m == "w8a8" else src for m in shape.methods], shape.methods))
    return shapes
