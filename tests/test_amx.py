"""servelm's AMX kernels (kernels/csrc/amx_linear.cpp, amx_attention.cpp) where the CPU has
AMX-BF16: the "amx" linear method's numbers and its batch invariance (the attention kernel
is checked with the backends, tests/test_attention.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm import tuning
from servelm.layers import amx
from servelm.layers import linear_methods as lm

pytestmark = pytest.mark.skipif(not amx.available(), reason="no AMX-BF16 here (or not built)")


def _layer(n=96, k=576, bias=True):
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(96, 576), (1056, 1536)])
def test_every_row_count_matches_the_reference_and_its_rows_alone(n, k):
    """Row blocks of 32 (2 x 2 tiles) and the zero-padded last block, tiles of exactly the
    call's rows up to 32: every row equals the same row computed in any other call, and
    the fp32 reference within bf16's rounding. 1056 x 1536: a thread's share of the weight
    runs in panels (amx_linear_kernel.h's kPanelBytes: 10 column pairs at K = 1536), the
    last one short, each passed by every row block in turn."""
    src = _layer(n, k)
    mod = lm.build("amx", src, torch.bfloat16)
    x = torch.randn(300, k).to(torch.bfloat16)
    whole = mod(x)
    want = x.float() @ src.weight.float().T + src.bias.float()
    torch.testing.assert_close(whole.float(), want, rtol=2e-2, atol=2e-2)
    for rows in (1, 7, 16, 17, 32, 33, 64, 65, 100, 192, 193):
        for start in (0, 300 - rows):
            assert torch.equal(mod(x[start:start + rows]), whole[start:start + rows]), (rows, start)
    assert mod(x[:0]).shape == (0, n)
    assert mod(x.view(3, 100, k)).shape == (3, 100, n)  # leading dims kept


def test_the_tuner_finds_it_row_invariant():
    src = _layer(bias=False)
    mod = lm.build("amx", src, torch.bfloat16)
    x = torch.randn(tuning.INVARIANCE_CALL, 576).to(torch.bfloat16)
    assert tuning.row_invariant(mod, x)


def test_shapes_and_dtypes_it_does_not_take_are_refused():
    assert lm.applies("amx", _layer(), torch.bfloat16, True)
    assert not lm.applies("amx", _layer(), torch.bfloat16, False)  # kernels off
    assert not lm.applies("amx", _layer(n=48), torch.bfloat16, True)  # not a column pair
    assert not lm.applies("amx", _layer(k=80), torch.bfloat16, True)  # K not a tile step
    assert not lm.applies("amx", _layer().float(), torch.float32, True)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        torch.ops.servelm_amx_linear.pack(torch.zeros(48, 576, dtype=torch.bfloat16))
    mod = lm.build("amx", _layer(), torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be bf16"):
        mod(torch.zeros(2, 576))
    with pytest.raises(RuntimeError, match="does not match"):
        mod(torch.zeros(2, 608, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantised_layers_run_on_their_weights_dequantised_to_bf16(fmt):
    """An int4 / int8 layer (the tuner's choice for a batch of rows on an AMX Xeon) computes
    with its own weights rounded to bf16, as the onednn method does, and stays row-invariant."""
    from servelm import quantization as Q

    src = Q.quantize_linear(_layer(), fmt)
    assert lm.applies("amx", src, torch.bfloat16, True)
    assert not lm.applies("amx", src, torch.float32, True)
    mod = lm.build("amx", src, torch.bfloat16)
    x = torch.randn(70, 576).to(torch.bfloat16)
    w = src.dequantize(torch.bfloat16).float()
    want = x.float() @ w.T + src.bias.float()
    torch.testing.assert_close(mod(x).float(), want, rtol=2e-2, atol=2e-2)
    assert tuning.row_invariant(mod, torch.randn(tuning.INVARIANCE_CALL, 576).to(torch.bfloat16))
