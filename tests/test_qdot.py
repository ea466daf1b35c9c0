"""The qdot linear method (kernels/csrc/qdot.cpp): int4 / int8 weights in AVX2 integer dot
products over activations quantised to int16 per block of 32."""

import pytest
import torch
from torch import nn

from servelm.layers import linear_methods as lm
from servelm.layers import qdot
from servelm.quantization import Int4Linear, Int8Linear, quantize_linear

pytestmark = pytest.mark.skipif(not qdot.available(), reason="qdot kernels need AVX2, FMA, F16C")


def _src(fmt, n, k, bias=True, seed=0):
    torch.manual_seed(seed)
    return quantize_linear(nn.Linear(k, n, bias=bias), fmt)


def _err(got, want):
    return (got.float() - want).abs().max().item() / want.abs().max().item()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(7, 64), (13, 32), (96, 128), (260, 576)])
def test_qdot_matches_the_dequantised_reference(fmt, n, k):
    """Any row count (the 4-row weight blocks pad N; 1-3 leftover activation rows), with and
    without bias, fp32 and bf16 activations, any leading shape."""
    for bias in (True, False):
        src = _src(fmt, n, k, bias)
        mod = qdot.QDotLinear(src)
        w = src.dequantize(torch.float32)
        for rows in (1, 2, 3, 5, 9):
            x = torch.randn(rows, k)
            want = x @ w.T + (src.bias if bias else 0)
            assert _err(mod(x), want) < 5e-4
            yb = mod(x.bfloat16())
            assert yb.dtype == torch.bfloat16 and _err(yb, want) < 2e-2
        x3 = torch.randn(2, 3, k)
        assert mod(x3).shape == (2, 3, n)
        assert torch.equal(mod(x3), mod(x3.reshape(6, k)).reshape(2, 3, n))
        assert mod(torch.randn(0, k)).shape == (0, n)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_qdot_extremes_do_not_saturate(fmt):
    """Full-range weights (int8 +-127, int4 0 and 15) against activations with one outlier per
    block and blocks of zeros: vpmaddubsw's int16 pair sums must not saturate."""
    n, k = 8, 128
    torch.manual_seed(3)
    if fmt == "int8":
        q = torch.full((n, k), 127, dtype=torch.int8)
        q[1::2] = -127
        src = Int8Linear(q, torch.full((n,), 0.01))
    else:
        lin = nn.Linear(k, n, bias=False)
        lin.weight.data = torch.where(torch.rand(n, k) > 0.5, 1.0, -1.0)
        src = Int4Linear.from_linear(lin)
    mod = qdot.QDotLinear(src)
    x = torch.full((3, k), 50.0)
    x[1] = -50.0
    x[2, :32] = 0.0           # a block of zeros (scale 0)
    x[2, 40] = 1000.0         # an outlier
    want = x @ src.dequantize(torch.float32).T
    assert _err(mod(x), want) < 5e-4


def test_qdot_rows_do_not_depend_on_the_batch():
    """Each row is quantised and reduced alone, in one order: bit-identical whatever else
    is in the call (what batch-invariant serving needs)."""
    for fmt in ("int4", "int8"):
        mod = qdot.QDotLinear(_src(fmt, 96, 256))
        x = torch.randn(64, 256)
        full = mod(x)
        for m in (1, 2, 3, 4, 7, 23):
            assert torch.equal(mod(x[:m]), full[:m])


def test_qdot_applies_only_where_it_runs():
    assert lm.applies("qdot", _src("int4", 8, 64), torch.float32, True)
    assert lm.applies("qdot", _src("int8", 8, 64), torch.bfloat16, True)
    assert not lm.applies("qdot", _src("int4", 8, 64), torch.float32, False)  # reference only
    assert not lm.applies("qdot", nn.Linear(64, 8), torch.float32, True)      # not quantised
    assert not lm.applies("qdot", _src("int8", 8, 48), torch.float32, True)   # K % 32
    lin = nn.Linear(128, 8)
    assert not lm.applies("qdot", Int4Linear.from_linear(lin, group_size=64), torch.float32, True)


def test_qdot_op_rejects_bad_operands_with_a_clear_error():
    mod = qdot.QDotLinear(_src("int4", 8, 64))
    with pytest.raises(RuntimeError, match="in_features"):
        mod(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.servelm_qdot.q4_linear(torch.randn(2, 64).double(), mod.qweight, mod.scales, 8)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.servelm_qdot.q4_linear(torch.randn(2, 64), mod.qweight, mod.scales, 20)
