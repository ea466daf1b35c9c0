"""MXFP4 weights kept as they are (servelm.quantization.mxfp4): the codes and exponents read
from llama.cpp's blocks and from an HF checkpoint's blocks and scales, the q8act panels they
are kept in, the kernels that multiply them with int8 activations (mxfp4_linear and the fused
moe_experts_mxfp4) against the dequantised weights, and a MoE layer holding them.
The engine-level load (gpt-oss's HF checkpoint and GGUF) is in test_gpt_oss.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from servelm.layers import q8act
from servelm.models.moe import SparseMoE, clamped_swiglu, tune_fused_experts
from servelm.quantization.mxfp4 import (MXFP4Weight, dequantize_panels, to_panels,
                                        to_panels_reference)

gguf = pytest.importorskip("gguf")
kernels = pytest.mark.skipif(not q8act.available(), reason="needs the q8act kernel (AVX2, F16C)")


def _ggml(w: torch.Tensor) -> tuple[MXFP4Weight, torch.Tensor, torch.Tensor]:
    """w [..., N, K] quantised by gguf-py: (its MXFP4Weight, gguf-py's values, the raw bytes)."""
    raw = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
    return MXFP4Weight.from_ggml(raw), values.reshape(w.shape), torch.from_numpy(raw.copy())


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: quantised per block of 32 to int8, in fp32."""
    q, d = q8act.quantize_reference(x)
    return (q.float().reshape(*x.shape[:-1], -1, 32) * d[..., None]).reshape(x.shape)


def test_codes_from_ggml_and_hf_hold_gguf_pys_values():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-3, 1, 96)  # exponents of a range
    mx, values, raw = _ggml(w)
    assert mx.shape == (3, 40, 96) and mx.blocks.shape == (3, 40, 3, 16)
    assert torch.equal(mx.dense(), values)
    # HF's blocks: the same codes, two to a byte in order (the low nibble first).
    codes = mx.codes().unflatten(-1, (3, 32))
    hf = MXFP4Weight.from_hf(codes[..., 0::2] | (codes[..., 1::2] << 4),
                             raw.view(3, 40, 3, 17)[..., 0])
    assert hf.source == "hf" and torch.equal(hf.blocks, mx.blocks)
    assert torch.equal(hf.exps, mx.exps)
    rows = torch.tensor([5, 0, 39])
    assert torch.equal(mx.rows(rows).dense(), values[:, rows])


def test_panels_hold_the_codes_and_exponents(monkeypatch):
    from servelm.quantization import numerics

    real = numerics.int4_codec
    w = torch.randn(40, 64) * 0.1  # 40 rows: the last panel padded
    mx, values, _ = _ggml(w)
    packed, exps = to_panels(mx)
    assert packed.shape == (3, 2, 2, 4, 32) and exps.shape == (3, 2, 16)
    assert torch.equal(dequantize_panels(packed, exps, 40), values)
    ref = to_panels_reference(mx)  # the C++ repack (where built) is PyTorch's, bit for bit
    assert torch.equal(ref[0], packed) and torch.equal(ref[1], exps)
    for codec in (True, False):  # written into given tensors (a layer's expert), both ways
        monkeypatch.setattr(numerics, "int4_codec", lambda t, on=codec: on and real(t))
        out = (torch.full_like(packed, 7), torch.full_like(exps, 7))
        assert to_panels(mx, out=out) is not None
        assert torch.equal(out[0], packed) and torch.equal(out[1], exps)
    assert torch.equal(dequantize_panels(packed, exps, 40, torch.bfloat16).float(), values)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_linear_is_the_dequantised_weight_on_int8_activations(dtype):
    """mxfp4_linear: to fp32 rounding, the exact weights times the activations quantised per
    block of 32; the AVX-512 VNNI and AVX2 micro-kernels agree; a row's output does not
    depend on how many rows share the call (its bits)."""
    g = torch.Generator().manual_seed(1)
    N, K = 72, 256
    mx, values, _ = _ggml(torch.randn(N, K, generator=g) * 0.05)
    packed, exps = to_panels(mx)
    bias = torch.randn(N, generator=g)
    x = torch.randn(17, K, generator=g).to(dtype)
    want = (_int8_rounded(x).double() @ values.double().T + bias.double()).float()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.01, atol=0.02)
    sides = [True, False] if torch.ops.servelm_q8act.has_wide() else [False]
    for wide in sides:
        for m in (1, 3, 5, 9, 17):
            got = torch.ops.servelm_q8act.mxfp4_linear(x[:m], packed, exps, N, bias, wide)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want[:m], **tol)
            alone = torch.ops.servelm_q8act.mxfp4_linear(x[m - 1:m], packed, exps, N, bias, wide)
            assert torch.equal(got[m - 1:], alone)
    with pytest.raises(RuntimeError, match="exps must be"):
        torch.ops.servelm_q8act.mxfp4_linear(x, packed, exps[:, :1], N, None)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.servelm_q8act.mxfp4_linear(x, packed, exps, N + 16, None)


def _moe(clamped: bool) -> SparseMoE:
    opts = dict(swiglu_limit=0.3, swiglu_alpha=1.702, expert_bias=True,
                router_bias=True) if clamped else {}
    torch.manual_seed(7)
    moe = SparseMoE(64, 64, 8, 3, act="silu", **opts)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


@pytest.mark.parametrize("clamped", [False, True], ids=["silu", "gpt-oss"])
def test_moe_layer_holds_and_runs_mxfp4_experts(clamped):
    """to_mxfp4 then load_mxfp4 (gate and up as llama.cpp's separate halves, down whole):
    without the kernels the layer is the one holding the dequantised experts, exactly (fp32);
    the fused op and the per-expert mxfp4_linear are those experts on int8-rounded
    activations (each token's row, each pair's activation row)."""
    dense = _moe(clamped)
    gate, gvals, _ = _ggml(dense.experts_gate_up[:, :64])
    up, uvals, _ = _ggml(dense.experts_gate_up[:, 64:])
    down, dvals, _ = _ggml(dense.experts_down)
    ref = copy.deepcopy(dense)
    with torch.no_grad():
        ref.experts_gate_up.copy_(torch.cat((gvals, uvals), 1))
        ref.experts_down.copy_(dvals)
    mx = copy.deepcopy(dense)
    mx.to_mxfp4()
    assert mx.expert_format == "mxfp4" and mx.quantized and not mx.mxfp4_complete
    assert mx.experts_gate_up.shape == (8, 128 // 16, 2, 2, 4, 32)
    mx.load_mxfp4("gate_up", "up", up)
    mx.load_mxfp4("down", "all", down)
    assert not mx.mxfp4_complete  # gate_up waits for its gate half
    mx.load_mxfp4("gate_up", "gate", gate)
    assert mx.mxfp4_complete
    with pytest.raises(ValueError, match="shape"):
        copy.deepcopy(mx).load_mxfp4("gate_up", "all", gate)  # half its rows
    mx.quantize_experts("int4")  # a later weight format leaves MXFP4 experts as they are
    assert mx.expert_format == "mxfp4"

    x = torch.randn(5, 64)
    mx.select(False)
    torch.testing.assert_close(mx(x), ref(x), rtol=1e-5, atol=1e-5)
    if not q8act.available():
        return
    weights, ids = mx.route(x)
    gb = mx.experts_gate_up_bias if clamped else torch.zeros(8, 128)
    db = mx.experts_down_bias if clamped else torch.zeros(8, 64)
    want = torch.zeros(5, 64)
    for t in range(5):
        for j in range(3):
            e = int(ids[t, j])
            h = _int8_rounded(x[t]) @ ref.experts_gate_up[e].T + gb[e]
            a = clamped_swiglu(h, 0.3, 1.702) if clamped else F.silu(h[:64]) * h[64:]
            want[t] += weights[t, j] * (_int8_rounded(a) @ ref.experts_down[e].T + db[e])
    fused = torch.ops.servelm_q8act.moe_experts_mxfp4(
        x, ids, weights, mx.experts_gate_up, mx.experts_gate_up_scale, mx.experts_down,
        mx.experts_down_scale, 3 if clamped else 0,
        *((mx.experts_gate_up_bias, mx.experts_down_bias) if clamped else (None, None)),
        *((0.3, 1.702) if clamped else (0.0, 1.0)))
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        torch.ops.servelm_q8act.moe_experts_mxfp4(
            x, ids + 8, weights, mx.experts_gate_up, mx.experts_gate_up_scale,
            mx.experts_down, mx.experts_down_scale, 0)

    xb = x.bfloat16()
    mb = copy.deepcopy(dense).to(torch.bfloat16)
    mb.to_mxfp4()
    for which, part, w in (("gate_up", "gate", gate), ("gate_up", "up", up),
                           ("down", "all", down)):
        mb.load_mxfp4(which, part, w)
    mb.select(True)  # bf16 activations: the kernels, fused for a few tokens
    assert mb._fused is not None and mb.act_dtype == torch.bfloat16
    model = torch.nn.ModuleList([mb])  # panels: no row order for the tuner to choose
    assert tune_fused_experts(model) is False
    mb._fused_rows = 5
    torch.testing.assert_close(mb(xb).float(), ref(xb.float()), rtol=0.05, atol=0.05)
    mb._fused_rows = 0  # an expert at a time: mxfp4_linear
    torch.testing.assert_close(mb(xb).float(), ref(xb.float()), rtol=0.05, atol=0.05)
