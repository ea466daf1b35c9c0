"""servelm's C++ int4 codec (kernels/csrc/int4_codec.cpp) against the PyTorch versions it
stands in for (servelm.quantization's *_reference functions), bit for bit."""

import pytest
import torch

from servelm import quantization as Q
from servelm.kernels import load_ops

pytestmark = pytest.mark.skipif(not load_ops("int4_codec"), reason="C++ kernels not built here")

SHAPES = [(40, 64, 32, False), (16, 256, 64, True), (100, 512, 128, False), (33, 256, 256, True),
          (1, 32, 32, True), (48, 1536, 32, False)]


def _weight(n: int, k: int, g: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with the groups that stress the rounding: all zeros (the float16 scale
    underflows to 0, so 0 / 0), constant, tiny, and an outlier."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if n > 9:
        w[3, :g] = 0.0
        w[5, g - g // 2:g + g // 2] = 0.25
        w[7, :5] = 1e-9
        w[9, 1] = 3.0
    return w


@pytest.mark.parametrize("n,k,g,sym", SHAPES)
def test_quantize_is_the_reference_bit_for_bit(n, k, g, sym):
    for w in (_weight(n, k, g), _weight(n, k, g, seed=3).bfloat16()):  # bf16 read as it is
        got = Q.quantize_int4(w, g, sym)
        want = Q.quantize_int4_reference(w, g, sym)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("n,k,g,sym", SHAPES)
def test_unpack_and_dequantize_are_the_reference_bit_for_bit(n, k, g, sym):
    packed, s, m = Q.quantize_int4_reference(_weight(n, k, g, seed=1), g, sym)
    codes = Q.unpack_int4(packed)
    assert codes.dtype == torch.uint8 and torch.equal(codes, Q.unpack_int4_reference(packed))
    assert int(codes.max()) <= 15
    for dtype in (torch.float32, torch.bfloat16):
        got = Q.dequantize_int4(packed, s, m, g, n, dtype)
        want = Q.dequantize_int4_reference(packed, s, m, g, n, dtype)
        assert got.dtype == dtype and got.shape == (n, k) and torch.equal(got, want)


def test_quantize_takes_any_float_layout():
    w = _weight(32, 128, 32).t().contiguous().t()  # column-major
    for x in (w, w.bfloat16()):
        got = Q.quantize_int4(x, 32)
        want = Q.quantize_int4_reference(x, 32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_ops_reject_bad_operands_with_a_clear_error():
    op = torch.ops.servelm_int4_codec
    packed, s, m = Q.quantize_int4(_weight(16, 64, 32), 32)
    with pytest.raises(RuntimeError, match="packed must be contiguous uint8"):
        op.unpack(packed.float())
    with pytest.raises(RuntimeError, match="group_size 48 must be a multiple of 8 dividing"):
        op.dequantize(packed, s, m, 48, torch.float32)
    with pytest.raises(RuntimeError, match="scales and mins must be contiguous float16"):
        op.dequantize(packed, s.float(), m, 32, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be float32 or bfloat16"):
        op.dequantize(packed, s, m, 32, torch.float16)
    with pytest.raises(RuntimeError, match="w must be contiguous float32 or bfloat16"):
        op.quantize(torch.zeros(16, 64, dtype=torch.float16), 32, False)


@pytest.mark.parametrize("n,k", [(16, 32), (40, 256), (33, 1536)])
def test_q8act_panels_are_pack_q4_of_the_codes_bit_for_bit(n, k):
    from servelm.layers import q8act

    packed = Q.quantize_int4_reference(_weight(n, k, 32, seed=2), 32)[0]
    got = torch.ops.servelm_int4_codec.to_q8act(packed)
    assert torch.equal(got, q8act.pack_q4(Q.unpack_int4_reference(packed)))
    with pytest.raises(RuntimeError, match="in_features 8 must be a multiple of 32"):
        torch.ops.servelm_int4_codec.to_q8act(packed[:, :64].contiguous())


@pytest.mark.parametrize("g", [8, 24])
def test_groups_of_other_sizes_take_the_scalar_path_bit_for_bit(g):
    # The vector paths take groups of a multiple of 16 inputs; the op accepts any multiple of 8.
    op, w = torch.ops.servelm_int4_codec, _weight(40, 96, g, seed=4)
    got, want = op.quantize(w, g, False), Q.quantize_int4_reference(w, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(op.dequantize(*want, g, dtype)[:40],
                           Q.dequantize_int4_reference(*want, g, 40, dtype))
