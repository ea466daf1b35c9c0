"""The q8act linear method (kernels/csrc/q8act.cpp): int4 layers times activations quantised
per call to int8 per block of 32, summed in integers (AVX2 byte multiply-add, or AVX-512
VNNI's where the CPU has it: the same bits)."""

import pytest
import torch
from torch import nn

from servelm import quantization as Q
from servelm.layers import linear_methods as lm
from servelm.layers import q8act

pytestmark = pytest.mark.skipif(not q8act.available(),
                                reason="q8act kernel not built here (AVX2, FMA, F16C)")

# N: a partial panel, whole panels, a partial last one; K: one block, several, group sizes
# 32..256. Rows: the 4-row micro-kernel and every tail.
SHAPES = [(7, 32, 32, True), (32, 64, 32, False), (50, 256, 64, True), (40, 512, 256, False),
          (17, 384, 128, True)]
ROWS = [1, 2, 3, 4, 5, 11, 64]


def _int4(n, k, group, bias, seed=0):
    torch.manual_seed(seed)
    return Q.Int4Linear.from_linear(nn.Linear(k, n, bias=bias), group)


def _dequantised_activations(x):
    q, d = q8act.quantize_reference(x)
    return (q.float().reshape(*x.shape[:-1], -1, q8act.BLOCK) * d[..., None]).reshape(x.shape)


def test_pack_puts_each_byte_where_the_kernel_reads_it():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    p = q8act.pack_q4(q)
    assert p.shape == (2, 2, 2, 4, 32) and p.dtype == torch.uint8
    # panel 1, block 1, half 0, chunk 2, output 3, t 1: inputs 32 + 16 + 1 (low), + 4 (high)
    byte = int(p[1, 1, 0, 2, 4 * 3 + 1])
    assert byte & 15 == q[16 + 3, 32 + 16 + 1] and byte >> 4 == q[16 + 3, 32 + 16 + 4 + 1]
    # half 1: outputs 8..15 of the panel
    byte = int(p[0, 0, 1, 3, 4 * 7 + 3])
    assert byte & 15 == q[15, 24 + 3] and byte >> 4 == q[15, 28 + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantisation_is_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 96) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[2, 32:64] = 0  # a block of zeros: d = 0, q = 0
    x[3, 5] = 1e3  # one large value dominates its block
    q, d, ds = torch.ops.servelm_q8act.quantize(x)
    want_q, want_d = q8act.quantize_reference(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert torch.equal(ds, d * want_q.reshape(9, 3, 32).sum(-1).float())
    assert not q[2, 32:64].any() and d[2, 1] == 0
    assert q.abs().max() == 127  # every block's largest value maps to +-127


@pytest.mark.parametrize("n,k,group,bias", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_is_the_exact_product_of_the_dequantised_operands(n, k, group, bias, rows):
    src = _int4(n, k, group, bias, seed=n * k + rows)
    mod = q8act.Int4Q8Linear(src)
    x = torch.randn(rows, k)
    got = mod(x)
    w = src.dequantize(torch.float32).double()
    want = _dequantised_activations(x).double() @ w.T
    if bias:
        want += src.bias.double()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # ... and within the activations' rounding of the fp32 product (int8 a block).
    exact = x.double() @ w.T + (src.bias.double() if bias else 0)
    assert (got.double() - exact).abs().max() <= 2e-2 * exact.abs().max()


@pytest.mark.parametrize("n,k,group,bias", SHAPES[2:4])
def test_bf16_in_bf16_out_rounded_once(n, k, group, bias):
    src = _int4(n, k, group, bias)
    mod = q8act.Int4Q8Linear(src)
    x = torch.randn(6, 3, k).to(torch.bfloat16)
    got = mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 3, n)
    # The same fp32 sums as for the widened input, rounded once.
    assert torch.equal(got, mod(x.float()).to(torch.bfloat16))


def test_rows_are_bit_identical_whatever_the_row_count():
    src = _int4(50, 256, 32, True)
    mod = q8act.Int4Q8Linear(src)
    x = torch.randn(70, 256).to(torch.bfloat16)
    full = mod(x)
    for m in (1, 2, 3, 4, 5, 7, 8, 23, 64):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[13:14]), full[13:14])  # a row alone = itself in any block position


@pytest.mark.skipif(not (q8act.available() and torch.ops.servelm_q8act.has_wide()),
                    reason="no AVX-512 VNNI micro-kernel in this build")
@pytest.mark.parametrize("n,k,group,bias", SHAPES[1:] + [(300, 576, 32, False)])
def test_the_vnni_kernel_gives_the_avx2_kernels_bits(n, k, group, bias):
    # The AVX-512 VNNI micro-kernel (8 rows a call) sums each block in int32 and then runs the
    # AVX2 one's fp32 steps: the same bits at every row count, both 8-row blocks and tails,
    # in fp32 and bf16, outliers included.
    src = _int4(n, k, group, bias, seed=k + n)
    mod = q8act.Int4Q8Linear(src)
    op = torch.ops.servelm_q8act.int4_linear
    x = torch.randn(37, k)
    x[5, 3] = 300.0
    x[20] *= 1e-3
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 4, 7, 8, 9, 16, 37):
            xm = x[:m].to(dtype)
            wide = op(xm, mod.qweight, mod.scales, mod.mins, group, n, mod.bias, True)
            narrow = op(xm, mod.qweight, mod.scales, mod.mins, group, n, mod.bias, False)
            assert wide.dtype == dtype and torch.equal(wide, narrow), (dtype, m)


def test_bad_operands_are_refused_with_a_clear_error():
    src = _int4(32, 64, 32, True)
    mod = q8act.Int4Q8Linear(src)
    op = torch.ops.servelm_q8act.int4_linear
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x's last dim"):
        mod(torch.randn(2, 65))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        mod(x.half())
    with pytest.raises(RuntimeError, match="bias must have out_features"):
        op(x, mod.qweight, mod.scales, mod.mins, 32, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="qweight must be"):
        op(x, mod.qweight.reshape(2, 2, -1), mod.scales, mod.mins, 32, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        op(x, mod.qweight, mod.scales, mod.mins, 32, 40)
    with pytest.raises(RuntimeError, match="group_size 48 must be a multiple of 32"):
        op(x, mod.qweight, mod.scales, mod.mins, 48, 32)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        op(x, mod.qweight, mod.scales.float(), mod.mins, 32, 32)
    with pytest.raises(RuntimeError, match="last dim a multiple of 32"):
        torch.ops.servelm_q8act.quantize(torch.randn(2, 40))


def test_applies_to_int4_with_bf16_activations_only():
    src = _int4(32, 64, 32, False)
    assert lm.applies("q8act", src, torch.bfloat16, True)
    assert not lm.applies("q8act", src, torch.float32, True)  # fp32 runs stay fp32-accurate
    assert not lm.applies("q8act", src, torch.bfloat16, False)  # kernels off
    i8 = Q.Int8Linear.from_linear(nn.Linear(64, 32))
    assert not lm.applies("q8act", i8, torch.bfloat16, True)
    plain = nn.Linear(64, 32).to(torch.bfloat16)
    assert not lm.applies("q8act", plain, torch.bfloat16, True)
    assert isinstance(lm.build("q8act", src, torch.bfloat16), q8act.Int4Q8Linear)


def test_auto_dtype_is_bf16_for_int4_where_q8act_runs():
    # On a CPU without native bf16 "auto" is bf16 for int4 weights where q8act runs (measured
    # on the Zen 3: TTFT 0.56x, 64 streams 1.9x int4 in fp32) and for bf16 weights where bfp
    # runs (one stream 1.83x fp32, 64 streams 1.39x, TTFT 0.84x); int8 stays fp32 (bfp runs
    # it as fast with fp32 activations), and so does everything without the kernels.
    from servelm.engine.engine import cpu_has_fast_bf16, resolve_dtype
    from servelm.layers import bfp

    cpu = torch.device("cpu")
    if cpu_has_fast_bf16():
        pytest.skip("bf16 is this CPU's default for every format")
    assert resolve_dtype("auto", cpu, "int4") == torch.bfloat16
    assert resolve_dtype("auto", cpu, "int4", cpu_kernels=False) == torch.float32
    assert resolve_dtype("auto", cpu, "int8") == torch.float32
    assert resolve_dtype("auto", cpu, None) == (torch.bfloat16 if bfp.available() else torch.float32)
    assert resolve_dtype("auto", cpu, None, cpu_kernels=False) == torch.float32
    assert resolve_dtype("float32", cpu, "int4") == torch.float32  # asked for: kept
    assert resolve_dtype("float32", cpu, None) == torch.float32


def test_unpacked_once_unpacks_a_layer_once_and_forgets_it_after():
    src = _int4(32, 64, 32, False)
    fresh = Q.unpack_int4(src.qweight)
    assert Q.unpack_int4(src.qweight) is not fresh  # no cache outside the block
    with Q.unpacked_once():
        a = Q.unpack_int4(src.qweight)
        assert Q.unpack_int4(src.qweight) is a and torch.equal(a, fresh)
        assert torch.equal(Q.unpack_int4(src.qweight, 20), fresh[:20])
        # the layouts built inside are the same as outside
        assert torch.equal(q8act.Int4Q8Linear(src).qweight, q8act.pack_q4(fresh))
    assert Q.unpack_int4(src.qweight) is not a


def test_unpacked_once_dequantises_a_layer_once_per_dtype():
    src = _int4(32, 64, 32, False)
    args = (src.qweight, src.scales, src.mins, src.group_size)
    fresh = {dt: Q.dequantize_int4(*args, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    assert Q.dequantize_int4(*args) is not Q.dequantize_int4(*args)  # no cache outside
    with Q.unpacked_once():
        w = {dt: Q.dequantize_int4(*args, dtype=dt) for dt in fresh}
        for dt, want in fresh.items():
            assert w[dt].dtype == dt and torch.equal(w[dt], want)
            assert Q.dequantize_int4(*args, dtype=dt) is w[dt]
            assert torch.equal(Q.dequantize_int4(*args, out_features=20, dtype=dt), want[:20])
        other = _int4(32, 64, 32, False, seed=1)  # another layer: its own weights
        assert torch.equal(other.dequantize(torch.float32),
                           Q.dequantize_int4(other.qweight, other.scales, other.mins, 32))
        assert not torch.equal(other.dequantize(torch.float32), w[torch.float32])
    assert Q.dequantize_int4(*args) is not w[torch.float32]
