"""The panels linear method (kernels/csrc/panels.cpp): fp32 and bf16 layers for any row count
on AVX2 + FMA, over the weight packed into 16-column panels."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import linear_methods as lm
from servelm.layers import panels

pytestmark = pytest.mark.skipif(not panels.available(),
                                reason="panels kernel not built here (AVX2, FMA)")

# N: one partial panel, whole panels, a partial last one; K: under one K block (256), over
# it with a tail (600 = 256 + 256 + 88), odd; 200 x 40: one row takes whole panels 4 at a
# time (12 whole panels and a partial one over the threads). Rows: a 6-row micro-kernel
# with every tail, and past the 96-row block.
SHAPES = [(7, 8, True), (32, 64, False), (33, 600, True), (50, 13, False), (1, 576, True),
          (200, 40, True)]
ROWS = [1, 2, 5, 6, 7, 13, 97, 130]


def test_pack_puts_sixteen_columns_k_major_and_zero_pads():
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    p = panels.pack(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, 2], w[:16, 2])  # panel 0, k 2: columns 0..15
    assert torch.equal(p[1, 1, :4], w[16:, 1])
    assert not p[1, :, 4:].any()


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_f_linear(n, k, bias, rows):
    torch.manual_seed(n * k + rows)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(rows, k)
    got = panels.PanelLinear(lin)(x)
    want = F.linear(x.double(), lin.weight.double(),
                    None if lin.bias is None else lin.bias.double())
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 97])
def test_bf16_weights_match_fp32_sums_rounded_once(n, k, bias, rows):
    torch.manual_seed(n * k + rows)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    mod = panels.PanelLinear(lin)
    assert mod.panels.dtype == torch.bfloat16  # packed in the weight's own bytes
    got = mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    b = None if lin.bias is None else lin.bias.double()
    want = F.linear(x.double(), lin.weight.double(), b)  # the exact sums, then one rounding
    assert (got.double() - want).abs().max() <= 2 ** -8 * want.abs().max() + 1e-5
    # fp32 activations on bf16 weights: fp32 out, the fp32 sums.
    torch.testing.assert_close(mod(x.float()).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(600, 75).to(dtype)
    mod = panels.PanelLinear(lin)
    x = torch.randn(130, 600).to(dtype)
    full = mod(x)
    for m in (1, 2, 5, 6, 7, 11, 96, 97):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[100:101]), full[100:101])  # a row in another micro-kernel slot
    assert mod(x[None])[0].shape == full.shape  # leading dims kept
    assert mod(x[:0]).shape == (0, 75)


def test_applies_to_fp32_and_bf16_layers_and_rejects_bad_operands():
    assert lm.applies("panels", nn.Linear(60, 8), torch.float32, True)  # any K
    assert isinstance(lm.build("panels", nn.Linear(64, 8), torch.float32), panels.PanelLinear)
    assert not lm.applies("panels", nn.Linear(64, 8), torch.float32, False)  # kernels off
    assert lm.applies("panels", nn.Linear(64, 8).to(torch.bfloat16), torch.bfloat16, True)
    assert not lm.applies("panels", nn.Linear(64, 8).to(torch.bfloat16), torch.float32, True)
    assert not lm.applies("panels", nn.Linear(64, 8).half(), torch.float16, True)
    op = torch.ops.servelm_panels.linear
    p = panels.pack(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="in_features"):
        op(torch.randn(2, 32), p, 8)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 64).to(torch.bfloat16), p, 8)
    with pytest.raises(RuntimeError, match="panels must be"):
        op(torch.randn(2, 64), torch.randn(8, 64), 8)
    with pytest.raises(RuntimeError, match="out_features 17"):
        op(torch.randn(2, 64), p, 17)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64), p, 8, torch.randn(3))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(torch.randn(2, 64).half(), p.to(torch.bfloat16), 8)
