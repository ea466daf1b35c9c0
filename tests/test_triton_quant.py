"""The Triton int4 dequantisation (servelm/kernels/triton_quant.py: what an int4 layer runs
on CUDA past tinygemm's rows) against the PyTorch reference.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1); with one, the same tests run it compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from servelm import quantization as Q
from servelm.kernels import triton_quant

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_quant.available(), reason="needs Triton")


@pytest.mark.parametrize("n,k,group", [(40, 256, 64), (16, 128, 32), (35, 384, 128),
                                       (1, 64, 32), (200, 512, 256)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantize_int4_gives_the_reference_weights(n, k, group, symmetric):
    """Rows past a 16-row tile's end (n not a multiple of 16), every group size, both
    kinds of zero point: the same fp32 weights as the reference (within an FMA's rounding),
    and the same bf16 weights within one bf16 rounding step."""
    g = torch.Generator().manual_seed(n * k + group)
    packed, s, m = Q.quantize_int4_reference(torch.randn(n, k, generator=g), group, symmetric)
    want = Q.dequantize_int4_reference(packed, s, m, group, n)
    got = triton_quant.dequantize_int4(packed.to(DEV), s.to(DEV), m.to(DEV), group, n,
                                       torch.float32)
    assert got.shape == (n, k) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    got16 = triton_quant.dequantize_int4(packed.to(DEV), s.to(DEV), m.to(DEV), group, n)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.cpu().float(), want, rtol=8e-3, atol=1e-6)


def test_dequantize_int4_rejects_operands_that_disagree():
    packed, s, m = Q.quantize_int4_reference(torch.randn(32, 128), 32)
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.dequantize_int4(packed, s, m, 64, 32)  # scales are per 32 inputs
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.dequantize_int4(packed, s, m, 32, 33)  # more rows than the tiles hold


@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (5, 96, 320), (17, 33, 128), (64, 64, 512),
                                   (40, 200, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_the_dequantised_matmul(m, n, k, dtype, with_bias):
    """Rows and columns past a block's end, K past a K block's (96, 320), each row-block
    size (1, 5: 16 rows; 17: 32; 40, 64: 64), with and without a bias: the matmul of the
    dequantised weight in fp32, within the output dtype's rounding (the sums are fp32)."""
    g = torch.Generator().manual_seed(m * n + k)
    q, s = Q.quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    want = x.float() @ Q.dequantize_int8(q, s, torch.float32).T
    if b is not None:
        want += b.float()
    got = triton_quant.int8_linear(x.to(DEV), q.to(DEV), s.to(DEV),
                                   None if b is None else b.to(DEV))
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want, rtol=1e-2, atol=2e-2)
    # Leading dims kept, a strided (non-contiguous rows) input read in place.
    x3 = torch.randn(2, m, 2 * k, generator=g).to(dtype)[..., :k]
    got3 = triton_quant.int8_linear(x3.to(DEV), q.to(DEV), s.to(DEV))
    want3 = x3.float() @ Q.dequantize_int8(q, s, torch.float32).T
    assert got3.shape == (2, m, n)
    torch.testing.assert_close(got3.cpu().float(), want3, rtol=1e-2, atol=2e-2)


def test_int8_linear_rejects_operands_that_disagree():
    q, s = Q.quantize_int8(torch.randn(32, 128))
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="int8 operands"):
        triton_quant.int8_linear(torch.randn(2, 64).to(DEV, bf), q.to(DEV), s.to(DEV))
    with pytest.raises(ValueError, match="int8 operands"):
        triton_quant.int8_linear(torch.randn(2, 128).to(DEV, bf), q.float().to(DEV), s.to(DEV))
    with pytest.raises(ValueError, match="int8 operands"):
        triton_quant.int8_linear(torch.randn(2, 128).to(DEV, bf), q.to(DEV), s.to(DEV),
                                 torch.zeros(31).to(DEV))
    with pytest.raises(ValueError, match="float32"):  # tf32 would round fp32 activations
        triton_quant.int8_linear(torch.randn(2, 128).to(DEV), q.to(DEV), s.to(DEV))
    empty = triton_quant.int8_linear(torch.randn(0, 128).to(DEV, bf), q.to(DEV), s.to(DEV))
    assert empty.shape == (0, 32)


def _w8a8_case(m, n, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    inv = torch.rand(k, generator=g) + 0.5
    x = torch.randn(m, k, generator=g) * (torch.rand(k, generator=g) * 4)
    x[:, 3] *= 30  # an outlier channel: its blocks' step is coarser
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // block, generator=g) / 100
    return x, inv, q, s, torch.randn(n, generator=g)


@pytest.mark.parametrize("m,k,block", [(1, 64, 16), (17, 192, 96), (40, 256, 128),
                                       (5, 96, 32), (3, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_quantize_is_the_cpu_rounding(m, k, block, dtype):
    """Each block's scale d = max|x * inv| / 127 exactly, and its codes round-to-nearest-even
    of x * inv / d, as servelm.layers.w8a8.reference (and the CPU kernel) computes them; a
    row of zeros quantises to zeros. On CUDA a fused multiply-add may round a product a
    hair's breadth from a half the other way: codes within one, rarely."""
    from servelm.layers import w8a8

    x, inv, *_ = _w8a8_case(m, k, k, block, m * k)
    x = x.to(dtype)
    x[0, :block] = 0
    q, d = triton_quant.w8a8_quantize(x.to(DEV), inv.to(DEV), block)
    rq, rd = w8a8.reference(x, inv, block)
    assert q.dtype == torch.int8 and q.shape == (m, k) and d.shape == (m, k // block)
    assert torch.equal(d.cpu(), rd) and d[0, 0] == 0 and not q[0, :block].any()
    diff = (q.cpu().int() - rq.int()).abs()
    assert diff.max() <= 1 and (diff.sum() == 0 if DEV.type == "cpu" else diff.sum() <= 2)


@pytest.mark.parametrize("m,n,k,block", [(1, 40, 64, 16), (17, 33, 192, 96), (70, 130, 256, 128),
                                         (5, 64, 320, 64), (33, 16, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_linear_is_its_integer_arithmetic(m, n, k, block, dtype, with_bias):
    """Rows and columns past a tile's end, blocks of 16 to 128 inputs (96: three 32-input
    dot products a block): each block's exact integer sum times the row's d and the
    column's block scale, summed over the blocks (+ bias), within fp32's rounding, then the
    output dtype's (one step: Triton's interpreter truncates to bf16)."""
    from servelm.layers import w8a8

    x, inv, q, s, b = _w8a8_case(m, n, k, block, m * n + k)
    x = x.to(dtype)
    bias = b if with_bias else None
    y = triton_quant.w8a8_linear(x.to(DEV), inv.to(DEV), q.to(DEV), s.to(DEV), block,
                                 None if bias is None else bias.to(DEV))
    assert y.shape == (m, n) and y.dtype == dtype
    xq, d = w8a8.reference(x, inv, block)
    sums = torch.einsum("mbk,nbk->mnb", xq.double().reshape(m, -1, block),
                        q.double().reshape(n, -1, block))
    want = (sums * d.double()[:, None, :] * s.double()[None]).sum(-1)
    if bias is not None:
        want = want + bias.double()
    step = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    tol = step * want.abs() + 1e-5 * want.abs().max()
    assert ((y.cpu().double() - want).abs() <= tol).all()


def test_w8a8_rejects_operands_that_disagree():
    x, inv, q, s, b = _w8a8_case(4, 32, 128, 64, 0)
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.w8a8_linear(x, inv, q, s, 32, b)  # scales are per 64 inputs
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.w8a8_linear(x, inv, q.float(), s, 64, b)
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.w8a8_quantize(x, inv, 48)  # not a block that divides K
    with pytest.raises(ValueError, match="do not agree"):
        triton_quant.w8a8_quantize(x, inv[:64], 64)
