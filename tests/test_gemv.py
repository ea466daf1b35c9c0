"""The gemv linear method (kernels/csrc/gemv.cpp): fp32 and bf16 layers for a few rows on
AVX2 + FMA, over the layer's own weight."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import gemv
from servelm.layers import linear_methods as lm
from servelm.models.moe import clamped_swiglu

pytestmark = pytest.mark.skipif(not gemv.available(),
                                reason="gemv kernel not built here (AVX2, FMA)")


# Both orders ("gemv": 4 weight rows at a time; "gemv_rows": a row after another, 32 columns
# a step with a tail of 8 at a time: k 40 and 8 take the tail only, 64 none, 200 both).
BY_ROW = pytest.mark.parametrize("by_row", [False, True], ids=["blocks", "rows"])


@BY_ROW
@pytest.mark.parametrize("n,k,bias",
                         [(96, 64, True), (33, 40, False), (7, 8, True), (1, 576, False),
                          (5, 200, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
def test_matches_f_linear(n, k, bias, rows, by_row):
    torch.manual_seed(n * k + rows)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(rows, k)
    got = gemv.GemvLinear(lin, by_row)(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@BY_ROW
@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (33, 40, False), (1, 576, False),
                                      (5, 200, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
def test_bf16_weights_match_fp32_sums_rounded_once(n, k, bias, rows, by_row):
    torch.manual_seed(n * k + rows)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    mod = gemv.GemvLinear(lin, by_row)
    got = mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    b = None if lin.bias is None else lin.bias.float()
    want = F.linear(x.float(), lin.weight.float(), b)  # the exact sums, then one rounding
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert (got.float() - want).abs().max() <= 2 ** -8 * want.abs().max() + 1e-5
    # fp32 activations on bf16 weights: fp32 out, the fp32 sums.
    torch.testing.assert_close(mod(x.float()), want, rtol=1e-5, atol=1e-5)


@BY_ROW
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch_and_weights_are_shared(dtype, by_row):
    torch.manual_seed(0)
    lin = nn.Linear(200, 75).to(dtype)
    mod = gemv.GemvLinear(lin, by_row)
    assert mod.weight.data_ptr() == lin.weight.data_ptr()  # no copy of the weight
    x = torch.randn(9, 200).to(dtype)
    full = mod(x)
    for m in range(1, 9):
        assert torch.equal(mod(x[:m]), full[:m]), m
    assert torch.equal(mod(x[3:4]), full[3:4])
    assert mod(x[None])[0].shape == full.shape  # leading dims kept
    assert mod(x[:0]).shape == (0, 75)


def test_applies_to_fp32_and_bf16_layers_and_rejects_bad_operands():
    assert lm.applies("gemv", nn.Linear(64, 8), torch.float32, True)
    assert lm.applies("gemv_rows", nn.Linear(64, 8), torch.float32, True)
    assert isinstance(lm.build("gemv_rows", nn.Linear(64, 8), torch.float32), gemv.GemvLinear)
    assert lm.build("gemv_rows", nn.Linear(64, 8), torch.float32).by_row
    assert not lm.applies("gemv", nn.Linear(64, 8), torch.float32, False)  # kernels off
    assert not lm.applies("gemv", nn.Linear(60, 8), torch.float32, True)  # K % 8
    assert lm.applies("gemv", nn.Linear(64, 8).to(torch.bfloat16), torch.bfloat16, True)
    assert not lm.applies("gemv", nn.Linear(64, 8).to(torch.bfloat16), torch.float32, True)
    assert not lm.applies("gemv", nn.Linear(64, 8).half(), torch.float16, True)
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
    bop = torch.ops.servelm_gemv.bf16_linear
    wb = w.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        bop(torch.randn(2, 64).half(), wb)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        bop(torch.randn(2, 64), w)  # fp32 weight to the bf16 op


# ---- a MoE layer's routed experts in one call (moe_experts) ----------------------------------


def _moe(act: str, dtype: torch.dtype, shared: int = 0, intermediate: int = 48, **options):
    from servelm.models.moe import SparseMoE

    torch.manual_seed(7)
    moe = SparseMoE(64, intermediate, 8, 3, act=act, shared_intermediate=shared, **options)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.to(dtype)


@pytest.mark.parametrize("by_row", [False, True], ids=["interleaved", "by-row"])
@pytest.mark.parametrize("act,code", [("silu", 0), ("gelu_tanh", 1), ("gelu", 2)])
def test_fused_moe_op_equals_the_experts_one_by_one(act, code, by_row):
    moe = _moe(act, torch.float32)
    x = torch.randn(5, 64)
    weights, ids = moe.route(x)
    got = torch.ops.servelm_gemv.moe_experts(x, ids, weights, moe.experts_gate_up,
                                             moe.experts_down, code, by_row=by_row)
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(3):
            e = int(ids[t, j])
            h = F.linear(x[t], moe.experts_gate_up[e])
            g, u = h.chunk(2)
            a = (F.silu(g) if act == "silu" else
                 F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")) * u
            want[t] += weights[t, j] * F.linear(a, moe.experts_down[e])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        torch.ops.servelm_gemv.moe_experts(x, ids + 8, weights, moe.experts_gate_up,
                                           moe.experts_down, code)


@pytest.mark.parametrize("by_row", [False, True], ids=["interleaved", "by-row"])
def test_fused_moe_op_runs_gpt_oss_clamped_biased_experts(by_row):
    moe = _moe("silu", torch.float32, swiglu_limit=0.3, swiglu_alpha=1.702, expert_bias=True,
               router_bias=True)
    x = torch.randn(4, 64)
    weights, ids = moe.route(x)
    got = torch.ops.servelm_gemv.moe_experts(
        x, ids, weights, moe.experts_gate_up, moe.experts_down, 3,
        moe.experts_gate_up_bias, moe.experts_down_bias, 0.3, 1.702, by_row)
    want = torch.zeros_like(x)
    for t in range(4):
        for j in range(3):
            want[t] += weights[t, j] * moe._clamped_expert(x[t:t + 1], int(ids[t, j]))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The clamp binds: some gates and ups are past the limit.
    assert (F.linear(x, moe.experts_gate_up[0]).abs() > 0.3).any()


@pytest.mark.parametrize("by_row", [False, True], ids=["interleaved", "by-row"])
@pytest.mark.parametrize("clamped", [False, True], ids=["silu", "gpt-oss"])
def test_int8_experts_compute_what_their_dequantised_weights_give(by_row, clamped):
    """quantize_experts: int8 rows, a scale each. The fused op (fp32 activations) and the
    per-expert path (PyTorch's int8 matmul for a few rows, the widened weight past
    INT8PACK_ROWS) give the outputs of the same layer holding the dequantised weights;
    with bf16 activations the fused op stays within bf16 rounding of the per-expert path."""
    import copy

    from servelm.models.moe import INT8PACK_ROWS

    opts = dict(swiglu_limit=0.3, swiglu_alpha=1.702, expert_bias=True,
                router_bias=True) if clamped else {}
    moe = _moe("silu", torch.float32, **opts)
    q = copy.deepcopy(moe)
    q.quantize_experts()
    assert q.experts_gate_up.dtype == q.experts_down.dtype == torch.int8
    assert q.experts_gate_up_scale.shape == (8, 96) and q.experts_down_scale.shape == (8, 64)
    ref = copy.deepcopy(moe)  # the dequantised experts, in fp32
    with torch.no_grad():
        ref.experts_gate_up.copy_(q.experts_gate_up.float() * q.experts_gate_up_scale[..., None])
        ref.experts_down.copy_(q.experts_down.float() * q.experts_down_scale[..., None])
    assert (ref.experts_gate_up - moe.experts_gate_up).abs().max() < 0.01  # int8's rounding
    x = torch.randn(5, 64)
    weights, ids = q.route(x)
    code = 3 if clamped else 0
    biases = (q.experts_gate_up_bias, q.experts_down_bias) if clamped else (None, None)
    limit = (0.3, 1.702) if clamped else (0.0, 1.0)
    got = torch.ops.servelm_gemv.moe_experts(
        x, ids, weights, q.experts_gate_up, q.experts_down, code, *biases, *limit, by_row,
        q.experts_gate_up_scale, q.experts_down_scale)
    torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-5)
    q.select(False)
    for rows in (3, 4 * INT8PACK_ROWS):
        x = torch.randn(rows, 64)
        most = torch.bincount(q.route(x)[1].flatten()).max().item()
        assert (most < INT8PACK_ROWS) == (rows == 3)  # both ways an expert's rows run
        torch.testing.assert_close(q(x), ref(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="scale"):  # int8 rows without their scales
        torch.ops.servelm_gemv.moe_experts(x[:1], ids[:1], weights[:1], q.experts_gate_up,
                                           q.experts_down, code)
    qb = copy.deepcopy(moe).to(torch.bfloat16)
    qb.quantize_experts()
    qb.select(True)
    assert qb._fused is not None and qb.act_dtype == torch.bfloat16
    xb = torch.randn(2, 64, dtype=torch.bfloat16)
    qb._fused_rows = 2
    fused = qb(xb)
    qb.select(False)
    torch.testing.assert_close(fused.float(), qb(xb).float(), rtol=0.05, atol=0.05)


def test_q4_panels_unpack_to_what_was_packed():
    from servelm.layers.q8act import pack_q4, unpack_q4

    q = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    assert torch.equal(unpack_q4(pack_q4(q)), q)


@pytest.mark.skipif(not lm.q8act.available(), reason="needs the q8act kernel (AVX2, F16C)")
@pytest.mark.parametrize("clamped", [False, True], ids=["silu", "gpt-oss"])
def test_int4_experts_run_the_dequantised_weights_on_int8_activations(clamped):
    """quantize_experts("int4"): groups of 32 in the q8act panels. The fused op is, to fp32
    rounding, the dequantised experts applied to activations quantised per block of 32 as
    the kernel quantises them (each token's row, then each pair's activation row); the
    per-expert path's int4_linear runs the same rounding; without the kernels the experts
    are dequantised."""
    import copy

    from servelm.layers.q8act import dequantize_q4, quantize_reference
    from servelm.models.moe import tune_fused_experts

    opts = dict(swiglu_limit=0.3, swiglu_alpha=1.702, expert_bias=True,
                router_bias=True) if clamped else {}
    moe = _moe("silu", torch.bfloat16, intermediate=64, **opts)
    q = copy.deepcopy(moe)
    q.quantize_experts("int4")
    assert q.expert_format == "int4" and q.experts_gate_up.dtype == torch.uint8
    assert q.experts_gate_up.shape == (8, 128 // 16, 64 // 32, 2, 4, 32)
    odd = copy.deepcopy(_moe("silu", torch.bfloat16))  # intermediate 48: int8
    odd.quantize_experts("int4")
    assert odd.expert_format == "int8"
    wg = torch.stack([dequantize_q4(q.experts_gate_up[e], q.experts_gate_up_scale[e],
                                    q.experts_gate_up_min[e]) for e in range(8)])
    wd = torch.stack([dequantize_q4(q.experts_down[e], q.experts_down_scale[e],
                                    q.experts_down_min[e]) for e in range(8)])
    assert (wg - moe.experts_gate_up.float()).abs().max() < 0.2  # int4's rounding
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weights, ids = q.route(x)

    def dq(t):
        qt, d = quantize_reference(t)
        return (qt.float().reshape(*t.shape[:-1], -1, 32) * d[..., None]).reshape(t.shape)

    gb = q.experts_gate_up_bias.float() if clamped else torch.zeros(8, 128)
    db = q.experts_down_bias.float() if clamped else torch.zeros(8, 64)
    want = torch.zeros(3, 64)
    for t in range(3):
        for j in range(3):
            e = int(ids[t, j])
            h = dq(x[t].float()) @ wg[e].T + gb[e]
            a = (clamped_swiglu(h, 0.3, 1.702) if clamped
                 else F.silu(h[:64]) * h[64:])
            want[t] += weights[t, j].float() * (dq(a) @ wd[e].T + db[e])
    q.select(True)
    assert q._fused is not None
    model = torch.nn.ModuleList([q])  # its panels have no row order for the tuner to choose
    assert tune_fused_experts(model) is False and model.moe_by_row is False
    q._fused_rows = 3
    got = q(x)
    torch.testing.assert_close(got.float(), want, rtol=0.01, atol=0.01)  # bf16 output
    fp32 = torch.ops.servelm_q8act.moe_experts(
        x.float(), ids, weights.float(), q.experts_gate_up, q.experts_gate_up_scale,
        q.experts_gate_up_min, q.experts_down, q.experts_down_scale, q.experts_down_min,
        3 if clamped else 0, *((q.experts_gate_up_bias, q.experts_down_bias) if clamped
                               else (None, None)), *((0.3, 1.702) if clamped else (0.0, 1.0)))
    torch.testing.assert_close(fp32, want, rtol=1e-4, atol=1e-4)
    q._fused_rows = 0  # the per-expert path: int4_linear, a row's activations rounded as bf16
    torch.testing.assert_close(q(x).float(), want, rtol=0.05, atol=0.05)
    q.select(False)  # no kernels: the experts dequantised
    ref = copy.deepcopy(moe).float()
    with torch.no_grad():
        ref.experts_gate_up.copy_(wg)
        ref.experts_down.copy_(wd)
    torch.testing.assert_close(q(x).float(), ref(x.float()), rtol=0.05, atol=0.05)


def test_bf16_moe_takes_the_fused_op_for_a_few_tokens_only():
    from servelm.models.moe import fused_rows

    assert (fused_rows(32, 8), fused_rows(128, 8), fused_rows(8, 2)) == (2, 8, 2)
    moe = _moe("silu", torch.bfloat16, shared=32)  # 8 experts, top 3: one token
    moe.select(True)
    assert moe._fused is not None
    most = fused_rows(8, 3)
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        fused = moe(x)
        moe.select(False)
        one_by_one = moe(x)
        moe.select(True)
        if rows > most:
            assert torch.equal(fused, one_by_one)  # the same path
        else:  # fp32 sums rounded once against bf16 matmuls rounded at each step
            torch.testing.assert_close(fused.float(), one_by_one.float(), rtol=0.05, atol=0.05)
    # gpt-oss's clamped, biased experts too (bf16).
    oss = _moe("silu", torch.bfloat16, swiglu_limit=0.3, swiglu_alpha=1.702, expert_bias=True)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    plain = oss(x)
    oss.select(True)
    assert oss._fused is not None
    torch.testing.assert_close(oss(x).float(), plain.float(), rtol=0.05, atol=0.05)
    # Not for fp32 (the reference), nor experts weighted on their input (Llama 4).
    assert _moe("silu", torch.float32)._fused is None
    llama4 = _moe("silu", torch.bfloat16, expert_input_weighted=True)
    llama4.select(True)
    assert llama4._fused is None
    fp32 = _moe("silu", torch.float32)
    fp32.select(True)
    assert fp32._fused is None


def test_the_fused_experts_order_is_measured_once_and_bound_in_every_layer():
    """tune_fused_experts times the two weight orders over a model's MoE layers, keeps the
    faster on the model and binds it into each layer's op, and the most tokens the op takes;
    a second call reuses both; a model without a fused MoE layer has none to choose."""
    from torch import nn

    from servelm.models.moe import tune_fused_experts

    model = nn.ModuleList([_moe("silu", torch.bfloat16) for _ in range(3)])
    for m in model:
        m.select(True)
    assert tune_fused_experts(model) in (False, True)
    chosen = model.moe_by_row
    for m in model:
        assert m._fused.keywords["by_row"] is chosen
        x = torch.randn(1, 64, dtype=torch.bfloat16)
        weights, ids = m.route(x)
        want = torch.ops.servelm_gemv.moe_experts(x, ids, weights, m.experts_gate_up,
                                                  m.experts_down, 0, by_row=chosen)
        assert torch.equal(m._fused(x, ids, weights, m.experts_gate_up, m.experts_down), want)
    # The fused op's token limit: the byte rule's or more, measured, on every layer.
    from servelm.models.moe import fused_rows

    rows = model.moe_fused_rows
    assert fused_rows(8, 3) <= rows <= 64 and all(m._fused_rows == rows for m in model)
    model.moe_by_row, model.moe_fused_rows = not chosen, 5  # kept: not measured again
    for m in model:
        m.select(True)
    assert tune_fused_experts(model) is (not chosen)
    assert all(m._fused_rows == 5 for m in model)
    assert tune_fused_experts(nn.ModuleList([_moe("silu", torch.float32)])) is None


def _assert_same_choice(ids, w, want_ids, want_w) -> None:
    """Each token's experts are the router's, each with its weight (to an ulp)."""
    for t in range(ids.shape[0]):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        ref = dict(zip(want_ids[t].tolist(), want_w[t].float().tolist()))
        assert got.keys() == ref.keys()
        for e in got:
            assert abs(got[e] - ref[e]) <= 2 ** -7 * abs(ref[e])


@pytest.mark.skipif(not lm.q8act.available(), reason="needs the q8act kernel (AVX2, F16C)")
@pytest.mark.parametrize("options", [dict(), dict(router_bias=True), dict(norm_topk_prob=False),
                                     dict(routed_scaling=2.5)],
                         ids=["renormalised", "bias", "softmax", "scaled"])
def test_moe_route_op_chooses_and_weighs_as_the_router(options):
    """servelm_q8act.moe_route (the decode steps' router, the DecodeStack's too): per token the
    router's top-k experts, weights renormalised or not, times the routed scaling, rounded
    to bf16; against SparseMoE's softmax router (bf16 logits from its own matmul: at most an
    ulp apart, ties in any order); a shared expert's gate as an extra row gives its logits
    and the same choice. A layer routing a few rows takes it."""
    moe = _moe("silu", torch.bfloat16, **options)
    if options.get("router_bias"):
        with torch.no_grad():
            moe.gate.bias.normal_(0, 1.0)  # enough to change which experts win
    x = torch.randn(40, 64).bfloat16()
    want_w, want_ids = moe.route(x)
    w, ids, none = torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, moe.gate.bias, 3,
                                                     moe.norm_topk_prob, moe.routed_scaling)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (40, 3)
    assert none.shape == (40, 0)
    # A shared expert's gate as the last row: its logits beside the same choice.
    g = torch.randn(1, 64).bfloat16()
    w2, ids2, logit = torch.ops.servelm_q8act.moe_route(
        x, torch.cat((moe.gate.weight, g)), moe.gate.bias, 3, moe.norm_topk_prob,
        moe.routed_scaling, True)
    assert torch.equal(w2, w) and torch.equal(ids2, ids) and logit.dtype == torch.bfloat16
    torch.testing.assert_close(logit.float(), x.float() @ g.float().T, rtol=0.01, atol=0.01)
    assert torch.equal(w, w.bfloat16().float())  # bf16 values
    _assert_same_choice(ids, w, want_ids, want_w)
    if "norm_topk_prob" not in options and "routed_scaling" not in options:
        torch.testing.assert_close(w.sum(-1), torch.ones(40), rtol=0.02, atol=0.02)
    moe.select(True)  # a few rows: the fused op routes with it
    assert moe._route_op is not None
    with pytest.raises(RuntimeError, match="top_k"):
        torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, None, 9, True, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.servelm_q8act.moe_route(x[:, :56], moe.gate.weight[:, :56].contiguous(),
                                          None, 3, True, 1.0)


@pytest.mark.skipif(not lm.q8act.available(), reason="needs the q8act kernel (AVX2, F16C)")
@pytest.mark.parametrize("groups,topk_group,norm", [(4, 2, True), (1, 1, True), (2, 1, False)])
def test_moe_route_op_runs_the_grouped_sigmoid_router(groups, topk_group, norm):
    """moe_route with groups (DeepSeek-V3's and GLM-4-MoE's router: sigmoid scores, the choice
    biased by the correction bias among the best groups, the weights the unbiased scores)
    against SparseMoE's PyTorch router; a layer routing a few rows takes it."""
    moe = _moe("silu", torch.bfloat16, router_scoring="sigmoid_grouped", n_group=groups,
               topk_group=topk_group, score_bias=True, routed_scaling=2.5,
               norm_topk_prob=norm)
    with torch.no_grad():
        moe.e_score_correction_bias.normal_(0, 0.3)  # enough to change which experts win
    x = torch.randn(40, 64).bfloat16()
    want_w, want_ids = moe.route(x)
    w, ids, _ = torch.ops.servelm_q8act.moe_route(
        x, moe.gate.weight, None, 3, norm, 2.5, False, groups, topk_group,
        moe.e_score_correction_bias)
    _assert_same_choice(ids, w, want_ids, want_w)
    if groups > 1:  # every token's experts in its topk_group groups
        per = 8 // groups
        assert all(len({e // per for e in row}) <= topk_group for row in ids.tolist())
    moe.select(True)
    assert moe._route_op is not None and moe._route_op.keywords["groups"] == groups
    with pytest.raises(RuntimeError, match="groups"):
        torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, None, 3, True, 1.0, False, 3, 1)


@pytest.mark.skipif(not lm.q8act.available(), reason="needs the q8act kernel (AVX2, F16C)")
def test_moe_route_op_runs_gemma4s_router():
    """moe_route with Gemma 4's router: its input normalised, times its learned scale and
    hidden ** -0.5 (in_scale, in_root, in_eps), the chosen weights times a per-expert scale
    (expert_scale), against SparseMoE's PyTorch router; a layer routing a few rows takes it,
    on the stream it is given (ExpertsBesideMLP routes on the stream, not the experts' input)."""
    moe = _moe("gelu_tanh", torch.bfloat16, router_input_norm=True, per_expert_scale=True)
    with torch.no_grad():
        moe.router_scale.uniform_(0.5, 1.5)
        moe.per_expert_scale.uniform_(0.5, 1.5)
    x = torch.randn(40, 64).bfloat16() * 3
    want_w, want_ids = moe.route(x)
    args = dict(in_scale=moe.router_scale.float(), in_root=64 ** -0.5, in_eps=moe.eps,
                expert_scale=moe.per_expert_scale.float())
    w, ids, _ = torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, None, 3, True, 1.0, **args)
    _assert_same_choice(ids, w, want_ids, want_w)
    plain, _, _ = torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, None, 3, True, 1.0)
    assert not torch.equal(plain, w)  # (each scale shows)
    moe.select(True)
    assert moe._route_op is not None and moe._route_op.keywords["in_root"] == 64 ** -0.5
    experts_input = torch.randn(1, 64).bfloat16()  # (one token: the fused op's rows here)
    with torch.no_grad():
        out = moe(experts_input, route=x[:1])
        want = moe._fused(experts_input, ids[:1], w[:1], moe.experts_gate_up, moe.experts_down)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="in_scale must have H = 64"):
        torch.ops.servelm_q8act.moe_route(x, moe.gate.weight, None, 3, True, 1.0,
                                          in_scale=torch.ones(8))


@pytest.mark.skipif(not lm.bfp.available(), reason="needs the bfp kernel (AVX2, F16C)")
def test_the_router_is_read_back_from_the_layer_the_tuner_chose():
    """The route op's weights from the router as tuned (the bfp method's blocks read back;
    plain and gemv layers' own), or none from a layout that is not read back (PyTorch
    routes then)."""
    from servelm.layers.bfp import BfpLinear

    moe = _moe("silu", torch.bfloat16)
    plain = moe.gate.weight.detach().clone()
    assert torch.equal(moe._router_weight(moe.gate), plain)
    moe.gate = BfpLinear(moe.gate)
    w = moe._router_weight(moe.gate)
    torch.testing.assert_close(w.float(), plain.float(), rtol=0.01, atol=1e-3)  # near bf16
    moe.select(True)
    assert moe._route_op is not None and torch.equal(moe._route_op.keywords["weight"], w)
    assert moe._router_weight(torch.nn.Identity()) is None
