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
    last one short, each passed by every row block in turn. From 4 row blocks at K = 576
    (kStreamMinBlocks, kL1ABytes) the weight's tiles load with the non-temporal hint:
    rows 100 and up must give the bits that 64 and 65 rows give."""
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


@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_gate_up_writes_silu_gate_times_up_bit_for_bit(bias):
    """gate_silu(): the [gate; up] weight's 16-output blocks alternated so each column pair is
    a gate block and its up block, and silu(gate) * up written in the kernel's epilogue: the
    same bits as the layer's product followed by servelm_ops.silu_and_mul, at every row-block
    shape; forward() still returns gate_up in the source's order."""
    from servelm.kernels import load_ops

    assert load_ops("ops")
    src = _layer(n=2 * 1536, k=576, bias=bias)
    plain = lm.build("amx", src, torch.bfloat16)
    gated = lm.build("amx", src, torch.bfloat16)
    gated.gate_silu()
    assert gated.gated and not plain.gated and "SiLU-gated" in repr(gated)
    x = torch.randn(300, 576).to(torch.bfloat16)
    for rows in (1, 5, 16, 17, 32, 33, 64, 100, 300):
        want = plain(x[:rows])
        assert torch.equal(gated(x[:rows]), want), rows  # its plain output: unchanged
        fused = gated.silu_mul(x[:rows])
        assert fused.shape == (rows, 1536)
        assert torch.equal(fused, torch.ops.servelm_ops.silu_and_mul(want)), rows
    assert gated.silu_mul(x[:0]).shape == (0, 1536)
    gated.gate_silu()  # a second call changes nothing
    assert torch.equal(gated(x), plain(x))


def test_a_swiglu_mlp_fuses_its_activation_only_on_amx():
    """GatedMLP.fuse_activation gates the amx modules of a SwiGLU gate_up (every bucket's,
    in a BucketedLinear) and leaves other methods and GeGLU alone; the MLP's kernel path
    gives the same bits after it as before."""
    from servelm.kernels import load_ops
    from servelm.models.layers import GatedMLP

    assert load_ops("ops")
    torch.manual_seed(0)
    mlp = GatedMLP(576, 1536).to(torch.bfloat16)
    src = mlp.gate_up_proj
    amx_mod = lm.build("amx", src, torch.bfloat16)
    onednn_mod = lm.build("onednn", src, torch.bfloat16)
    mlp.gate_up_proj = lm.BucketedLinear([onednn_mod, amx_mod, amx_mod, onednn_mod],
                                         ["onednn", "amx", "amx", "onednn"])
    xs = [torch.randn(rows, 576).to(torch.bfloat16) for rows in (1, 8, 70, 300)]
    mlp.select(True)  # the kernel path
    want = [mlp(x) for x in xs]
    assert mlp.fuse_activation() == 1 and amx_mod.gated and not hasattr(onednn_mod, "gated")
    assert mlp.fuse_activation() == 0
    for x, w in zip(xs, want):
        assert mlp.uses_kernels and torch.equal(mlp(x), w), x.shape[0]
    gelu = GatedMLP(576, 1536, act="gelu_tanh").to(torch.bfloat16)
    gelu.gate_up_proj = lm.build("amx", gelu.gate_up_proj, torch.bfloat16)
    assert gelu.fuse_activation() == 0 and not gelu.gate_up_proj.gated
