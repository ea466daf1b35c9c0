"""The gemv linear method (kernels/csrc/gemv.cpp): fp32 layers for a few rows on AVX2 + FMA,
over the layer's own weight."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import gemv
from servelm.layers import linear_methods as lm

pytestmark = pytest.mark.skipif(not gemv.available(),
                                reason="gemv kernel not built here (AVX2, FMA)")


@pytest.mark.parametrize("n,k,bias",
                         [(96, 64, True), (33, 40, False), (7, 8, True), (1, 576, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
def test_matches_f_linear(n, k, bias, rows):
    torch.manual_seed(n * k + rows)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(rows, k)
    got = gemv.GemvLinear(lin)(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_the_batch_and_weights_are_shared():
    torch.manual_seed(0)
    lin = nn.Linear(192, 75)
    mod = gemv.GemvLinear(lin)
    assert mod.weight.data_ptr() == lin.weight.data_ptr()  # no copy of the weight
    x = torch.randn(9, 192)
    full = mod(x)
    for m in range(1, 9):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[3:4]), full[3:4])
    assert mod(x[None])[0].shape == full.shape  # leading dims kept
    assert mod(x[:0]).shape == (0, 75)


def test_applies_only_to_fp32_layers_and_rejects_bad_operands():
    assert lm.applies("gemv", nn.Linear(64, 8), torch.float32, True)
    assert not lm.applies("gemv", nn.Linear(64, 8), torch.float32, False)  # kernels off
    assert not lm.applies("gemv", nn.Linear(60, 8), torch.float32, True)  # K % 8
    assert not lm.applies("gemv", nn.Linear(64, 8).to(torch.bfloat16), torch.bfloat16, True)
    op = torch.ops.servelm_gemv.f32_linear
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="in_features"):
        op(torch.randn(2, 32), w)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 64).to(torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(2, 64), torch.randn(64, 8).t())
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64), w, torch.randn(3))
