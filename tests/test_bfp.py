"""The bfp linear method (kernels/csrc/bfp.cpp): bf16 layers as block floating point, int16
mantissas sharing a power-of-two exponent per block of 64 inputs, summed exactly in int32."""

import pytest
import torch
from torch import nn

from servelm.layers import bfp
from servelm.layers import linear_methods as lm

pytestmark = pytest.mark.skipif(not bfp.available(),
                                reason="bfp kernel not built here (AVX2, FMA, F16C)")

# N: a partial panel, whole panels, a partial last one; K: one block, a partial block, several.
SHAPES = [(7, 64, True), (32, 100, False), (50, 576, True), (40, 1536, False), (17, 130, True)]
# The 6-row micro-kernel and every tail; 1: the one-row path (four panels at a time); 97: a
# second row block.
ROWS = [1, 2, 3, 5, 6, 7, 13, 97]


def _linear(n, k, bias, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # weights of several magnitudes, so blocks get different exponents
        lin.weight.mul_(torch.logspace(-2, 1, k)[torch.randperm(k)])
    return lin.to(torch.bfloat16)


def _dequantised_weight(wq, ws, n, k):
    """[N, K] fp64 from the panels: each mantissa times its block's scale."""
    np_, half = wq.shape[:2]
    q = wq.transpose(1, 2).reshape(np_ * 16, half * 2).double()
    s = ws.transpose(1, 2).reshape(np_ * 16, -1).double().repeat_interleave(bfp.BLOCK, 1)
    return (q * s)[:n, :k]


def _dequantised_activations(x):
    q, d = bfp.quantize_reference(x)
    return (q.double() * d.double().repeat_interleave(bfp.BLOCK, 1))[:, : x.shape[-1]]


def test_pack_puts_each_mantissa_where_the_kernel_reads_it():
    w = torch.zeros(20, 130)
    w[17, 65] = 3.0  # panel 1, output 1 of it; block 1, pair 0, second of the pair
    wq, ws = torch.ops.servelm_bfp.pack(w.to(torch.bfloat16))
    assert wq.shape == (2, 96, 16, 2) and wq.dtype == torch.int16  # K padded to 192
    assert ws.shape == (2, 3, 16) and ws.dtype == torch.float32
    assert wq[1, 32, 1, 1] == 3 * 2 ** 10 and ws[1, 1, 1] == 2.0 ** -10  # 3 = 0.75 * 2^2
    assert int((wq != 0).sum()) == 1 and int((ws != 0).sum()) == 1  # other blocks: zero


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_is_the_reference_bit_for_bit(n, k, bias, dtype):
    w = _linear(n, k, bias).weight.to(dtype)
    wq, ws = torch.ops.servelm_bfp.pack(w)
    want_q, want_s = bfp.pack_reference(w)
    assert torch.equal(wq, want_q) and torch.equal(ws, want_s)
    assert wq.abs().max() < 2 ** bfp.W_BITS


def test_bf16_weights_near_their_blocks_largest_are_exact():
    w = _linear(48, 576, False).weight
    wq, ws = torch.ops.servelm_bfp.pack(w)
    back = _dequantised_weight(wq, ws, 48, 576)
    blocks = w.double().abs().reshape(48, -1, bfp.BLOCK)
    near = (blocks >= blocks.amax(-1, keepdim=True) / 16).reshape(48, 576)
    assert torch.equal(back[near], w.double()[near])
    # ... and the rest within 2^-12 of their block's largest
    err = (back - w.double()).abs().reshape(48, -1, bfp.BLOCK)
    assert (err <= blocks.amax(-1, keepdim=True) * 2.0 ** -12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantisation_is_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 200) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[2, 64:128] = 0  # a block of zeros: d = 0, q = 0
    x[3, 5] = 1e3  # one large value dominates its block
    x[4, 128:192] = 1e-36  # a block too small to scale: zero
    q, d = torch.ops.servelm_bfp.quantize(x)
    want_q, want_d = bfp.quantize_reference(x)
    assert q.shape == (9, 256) and d.shape == (9, 4)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert not q[2, 64:128].any() and d[2, 1] == 0 and d[4, 2] == 0 and not q[:, 200:].any()
    assert q.abs().max() <= 2 ** bfp.X_BITS


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_is_the_exact_product_of_the_block_operands(n, k, bias, rows):
    lin = _linear(n, k, bias, seed=n * k + rows)
    mod = bfp.BfpLinear(lin)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = mod(x.float())  # fp32 out: the sums before any bf16 rounding
    w = _dequantised_weight(mod.wq, mod.ws, n, k)
    want = _dequantised_activations(x) @ w.T + (lin.bias.double() if bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_is_the_bf16_product_well_within_bf16s_output_rounding():
    # Weights of one scale (the model's are: 1.5e-4 to 4.2e-4 of the output's largest over
    # SmolLM2-135M's layers, bf16's own output rounding 2.8e-3): 2^-14 measured.
    torch.manual_seed(3)
    lin = nn.Linear(576, 256).to(torch.bfloat16)
    x = torch.randn(64, 576).to(torch.bfloat16)
    got = bfp.BfpLinear(lin)(x.float()).double()
    exact = x.double() @ lin.weight.double().T + lin.bias.double()
    assert (got - exact).abs().max() <= 2.0 ** -12 * exact.abs().max()


def test_bf16_in_bf16_out_rounded_once():
    mod = bfp.BfpLinear(_linear(50, 576, True))
    x = torch.randn(6, 3, 576).to(torch.bfloat16)
    got = mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 3, 50)
    assert torch.equal(got, mod(x.float()).to(torch.bfloat16))


def test_rows_are_bit_identical_whatever_the_row_count():
    mod = bfp.BfpLinear(_linear(200, 576, True))  # 13 panels: one row takes 4 at a time
    x = torch.randn(200, 576).to(torch.bfloat16)
    full = mod(x)
    for m in (1, 2, 5, 6, 7, 12, 64, 97, 150):
        assert torch.equal(mod(x[:m]), full[:m]), m
    for r in (13, 96, 199):  # a row alone (the one-row path) = itself in any block position
        assert torch.equal(mod(x[r:r + 1]), full[r:r + 1]), r


def test_inf_or_nan_gives_nan_not_garbage():
    mod = bfp.BfpLinear(_linear(16, 128, False))
    x = torch.randn(3, 128).to(torch.bfloat16)
    x[1, 70] = float("inf")
    x[2, 3] = float("nan")
    y = mod(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    lin = _linear(16, 128, False)
    with torch.no_grad():
        lin.weight[4, 100] = float("nan")
    y = bfp.BfpLinear(lin)(torch.randn(2, 128).to(torch.bfloat16))
    assert torch.isnan(y[:, 4]).all() and torch.isfinite(y[:, 5]).all()


def test_bad_operands_are_refused_with_a_clear_error():
    mod = bfp.BfpLinear(_linear(32, 128, True))
    op = torch.ops.servelm_bfp.linear
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not pad to the weight's 128"):
        mod(torch.randn(2, 200).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        mod(x.half())
    with pytest.raises(RuntimeError, match="bias must have out_features"):
        op(x, mod.wq, mod.ws, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="wq must be"):
        op(x, mod.wq.reshape(2, 64, 32), mod.ws, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        op(x, mod.wq, mod.ws, 40)
    with pytest.raises(RuntimeError, match="ws must be"):
        op(x, mod.wq, mod.ws.double(), 32)
    with pytest.raises(RuntimeError, match="weight must be a bfloat16 or float32"):
        torch.ops.servelm_bfp.pack(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16"):
        torch.ops.servelm_bfp.quantize(torch.zeros(2, 8, dtype=torch.int32))


def test_applies_to_bf16_layers_with_bf16_activations_only():
    lin = _linear(32, 64, False)
    assert lm.applies("bfp", lin, torch.bfloat16, True)
    assert not lm.applies("bfp", lin, torch.bfloat16, False)  # kernels off
    assert not lm.applies("bfp", lin.float(), torch.float32, True)  # fp32 runs stay fp32
    from servelm import quantization as Q
    i4 = Q.Int4Linear.from_linear(nn.Linear(64, 32), 32)
    assert not lm.applies("bfp", i4, torch.bfloat16, True)
    assert isinstance(lm.build("bfp", lin, torch.bfloat16), bfp.BfpLinear)


# ---------------------------------------------------------------- int8 weights

def _int8(n, k, bias, seed=0):
    from servelm import quantization as Q

    torch.manual_seed(seed)
    return Q.Int8Linear.from_linear(nn.Linear(k, n, bias=bias))


def test_int8_panels_are_the_codes_and_their_scales():
    src = _int8(20, 130, False)
    mod = bfp.BfpLinear(src)
    assert mod.wq.dtype == torch.int8 and mod.wq.shape == (2, 96, 16, 2)  # a byte a weight
    back = _dequantised_weight(mod.wq, mod.ws, 20, 130)
    assert torch.equal(back.float(), src.dequantize(torch.float32))
    assert not mod.wq.reshape(2, 96, 16, 2).transpose(1, 2).reshape(32, 192)[20:].any()


def test_dequantize_gives_the_weights_it_computes_with():
    """BfpLinear.dequantize (what a MoE router on the tuned bfp method is read back as): each
    mantissa times its block's scale, for bf16 and int8 layers."""
    for src in (_linear(50, 576, True), _int8(20, 130, False)):
        mod = bfp.BfpLinear(src)
        want = _dequantised_weight(mod.wq, mod.ws, src.out_features, src.in_features)
        assert torch.equal(mod.dequantize(torch.float64), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_blocks_are_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(5, 200) * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
    x[1, 7] = 2.0 ** 20 * (1 - 2.0 ** -20)  # fp32 rounds it up to 2^15 of the scale: clamped
    q, d = torch.ops.servelm_bfp.quantize(x, True)
    want_q, want_d = bfp.quantize_reference(x, int8_weights=True)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert q.abs().max() <= 2 ** bfp.X8_BITS - 1


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_the_exact_product_of_the_block_operands(n, k, bias, rows, dtype):
    src = _int8(n, k, bias, seed=n + k + rows)
    mod = bfp.BfpLinear(src)
    x = torch.randn(rows, k).to(dtype)
    got = mod(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    w = src.dequantize(torch.float32).double()
    q, d = bfp.quantize_reference(x, int8_weights=True)
    xd = (q.double() * d.double().repeat_interleave(bfp.BLOCK, 1))[:, :k]
    want = xd @ w.T + (src.bias.double() if bias else 0)
    if dtype == torch.float32:
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    else:
        assert torch.equal(got, mod(x.float()).to(dtype))  # the same sums, rounded once
    # ... and fp32-accurate: 15-bit activations, the fp32 runs' known-answer tolerance (1e-3)
    exact = x.double() @ w.T + (src.bias.double() if bias else 0)
    assert (mod(x.float()).double() - exact).abs().max() <= 1e-4 * exact.abs().max()


def test_int8_rows_are_bit_identical_whatever_the_row_count():
    mod = bfp.BfpLinear(_int8(200, 576, True))
    x = torch.randn(120, 576)
    full = mod(x)
    for m in (1, 2, 6, 7, 64, 97):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[50:51]), full[50:51])


def test_applies_to_int8_layers_with_fp32_or_bf16_activations():
    src = _int8(32, 64, False)
    assert lm.applies("bfp", src, torch.float32, True)
    assert lm.applies("bfp", src, torch.bfloat16, True)
    assert not lm.applies("bfp", src, torch.float32, False)
    assert isinstance(lm.build("bfp", src, torch.float32), bfp.BfpLinear)
    with pytest.raises(RuntimeError, match="q must be a non-empty int8"):
        torch.ops.servelm_bfp.pack_int8(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.servelm_bfp.pack_int8(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
