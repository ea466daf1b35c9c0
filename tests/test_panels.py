"""The panels linear method (kernels/csrc/panels.cpp): fp32, bf16, int4 and int8 layers for any
row count on AVX2 + FMA, over the weight packed into 16-column panels."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm import quantization as Q
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
    for m in (1, 2, 5, 6, 7, 11, 23, 24, 96, 97):  # bf16: widened per call from 24 rows
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


# ---- int4: panels of nibbles, decoded to fp32 a K block at a time

def _int4(n, k, bias, group_size=32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, Q.Int4Linear.from_linear(lin, group_size)


def _fp32_panels_of(src, lin):
    """An fp32 PanelLinear over src's dequantised weight (and lin's bias)."""
    ref = nn.Linear(src.in_features, src.out_features, bias=lin.bias is not None)
    with torch.no_grad():
        ref.weight.copy_(src.dequantize(torch.float32))
        if lin.bias is not None:
            ref.bias.copy_(lin.bias)
    return panels.PanelLinear(ref)


def test_pack_q4_puts_columns_j_and_j_plus_8_in_one_byte():
    q = torch.randint(0, 16, (32, 5), dtype=torch.uint8)
    p = panels.pack_q4(q)
    assert p.shape == (2, 5, 8) and p.dtype == torch.uint8
    assert torch.equal(p[1, 3] & 15, q[16:24, 3]) and torch.equal(p[1, 3] >> 4, q[24:32, 3])


# N: a partial panel, whole ones; K: under one K block (256), over it with a tail; every
# group size; rows: 1-4 decode in registers (1 and 2 rows two panels at a time: 24 outputs
# pair a whole panel with a partial one on one thread), more into a block buffer (the
# micro-kernel's tails, past the 96-row block).
@pytest.mark.parametrize("n,k,bias,group", [(7, 64, True, 32), (48, 576, False, 32),
                                            (40, 384, True, 128), (33, 320, False, 64),
                                            (16, 768, True, 256), (24, 64, True, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 97, 130])
def test_int4_is_fp32_panels_on_the_dequantised_weight_bit_for_bit(n, k, bias, group, rows):
    lin, src = _int4(n, k, bias, group, seed=n + rows)
    mod = lm.build("panels", src, torch.float32)
    assert isinstance(mod, panels.Int4PanelLinear)
    x = torch.randn(rows, k)
    got = mod(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, _fp32_panels_of(src, lin)(x))


def test_int4_takes_bf16_activations_and_rounds_once():
    lin, src = _int4(40, 256, True)
    mod = panels.Int4PanelLinear(src)
    x = torch.randn(9, 256).to(torch.bfloat16)
    got = mod(x)
    assert got.dtype == torch.bfloat16
    want = _fp32_panels_of(src, lin)(x.float())  # the fp32 sums of the bf16 inputs
    assert torch.equal(got, want.to(torch.bfloat16))


def test_int4_rows_do_not_depend_on_the_batch():
    _, src = _int4(75, 512, False)
    mod = panels.Int4PanelLinear(src)
    x = torch.randn(130, 512)
    full = mod(x)
    for m in (1, 2, 3, 4, 5, 6, 7, 96, 97):  # both paths: the same bits
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[100:101]), full[100:101])
    assert mod(x[:0]).shape == (0, 75)


def test_int4_applies_to_int4_layers_and_rejects_bad_operands():
    _, src = _int4(8, 64, False)
    assert lm.applies("panels", src, torch.float32, True)
    assert lm.applies("panels", src, torch.bfloat16, True)
    assert not lm.applies("panels", src, torch.float16, True)
    assert not lm.applies("panels", src, torch.float32, False)  # kernels off
    mod = panels.Int4PanelLinear(src)
    op = torch.ops.servelm_panels.int4_linear
    args = (mod.qpanels, mod.scales, mod.mins)
    with pytest.raises(RuntimeError, match="in_features"):
        op(torch.randn(2, 32), *args, 32, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half(), *args, 32, 8)
    with pytest.raises(RuntimeError, match="qpanels must be"):
        op(torch.randn(2, 64), mod.qpanels.float(), mod.scales, mod.mins, 32, 8)
    with pytest.raises(RuntimeError, match="out_features 17"):
        op(torch.randn(2, 64), *args, 32, 17)
    with pytest.raises(RuntimeError, match="group_size 48"):
        op(torch.randn(2, 64), *args, 48, 8)
    with pytest.raises(RuntimeError, match="scales and mins"):
        op(torch.randn(2, 64), mod.qpanels, mod.scales.float(), mod.mins, 32, 8)
    with pytest.raises(RuntimeError, match="scales and mins"):
        op(torch.randn(2, 64), *args, 64, 8)  # groups of 64: scales for 32 do not fit
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64), *args, 32, 8, torch.randn(3))


# ---- int8: panels of int8 and per-output scales, decoded to fp32 a K block at a time

@pytest.mark.parametrize("n,k,bias", [(7, 64, True), (48, 576, False), (40, 300, True)])
@pytest.mark.parametrize("rows", [1, 4, 13, 97])
def test_int8_is_fp32_panels_on_the_dequantised_weight_bit_for_bit(n, k, bias, rows):
    torch.manual_seed(n + rows)
    lin = nn.Linear(k, n, bias=bias)
    src = Q.quantize_linear(lin, "int8")
    assert lm.applies("panels", src, torch.float32, True)
    mod = lm.build("panels", src, torch.float32)
    assert isinstance(mod, panels.Int8PanelLinear)
    x = torch.randn(rows, k)
    got = mod(x)
    assert got.shape == (rows, n) and torch.equal(got, _fp32_panels_of(src, lin)(x))
    xb = x.to(torch.bfloat16)  # bf16 activations: the fp32 sums, rounded once
    assert torch.equal(mod(xb), _fp32_panels_of(src, lin)(xb.float()).to(torch.bfloat16))


def test_int8_rows_do_not_depend_on_the_batch_and_bad_operands_are_named():
    torch.manual_seed(0)
    src = Q.quantize_linear(nn.Linear(320, 75, bias=False), "int8")
    mod = panels.Int8PanelLinear(src)
    x = torch.randn(130, 320)
    full = mod(x)
    for m in (1, 2, 5, 6, 7, 96, 97):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert not lm.applies("panels", src, torch.float16, True)
    op = torch.ops.servelm_panels.int8_linear
    with pytest.raises(RuntimeError, match="in_features"):
        op(torch.randn(2, 32), mod.qpanels, mod.scales, 75)
    with pytest.raises(RuntimeError, match="qpanels must be"):
        op(x, mod.qpanels.float(), mod.scales, 75)
    with pytest.raises(RuntimeError, match="out_features 17"):
        op(x, mod.qpanels, mod.scales, 17)
    with pytest.raises(RuntimeError, match="scales must be"):
        op(x, mod.qpanels, mod.scales[:75], 75)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.half(), mod.qpanels, mod.scales, 75)

