"""oneDNN-prepacked linear layers (servelm/prepack.py) against F.linear, and the engine
with them against the engine without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from servelm.prepack import PackedLinear, prepack_supported

needs_prepack = pytest.mark.skipif(not prepack_supported(torch.float32, "cpu"),
                                   reason="oneDNN prepacking unavailable here")


def _linear(n, k, bias, dtype, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin.to(dtype)


@needs_prepack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 5, 576), (0, 576), (200, 576)])
@pytest.mark.parametrize("n", [1728, 33, 7])
def test_packed_linear_matches_f_linear(dtype, bias, shape, n):
    if not prepack_supported(dtype, "cpu"):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    lin = _linear(n, 576, bias, dtype)
    packed = PackedLinear(lin)
    x = torch.randn(*shape).to(dtype)
    got, want = packed(x), F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape and got.dtype == dtype
    if want.numel():
        err = (got.float() - want.float()).abs().max().item()
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding
        assert err <= tol * want.float().abs().max().item()


@needs_prepack
def test_packed_linear_takes_non_contiguous_input():
    lin = _linear(64, 96, True, torch.float32)
    packed = PackedLinear(lin)
    x = torch.randn(96, 10).t()  # [10, 96], transposed strides
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_prepack
def test_packed_linear_rejects_other_dtypes_by_name():
    packed = PackedLinear(_linear(32, 64, False, torch.float32))
    with pytest.raises(TypeError, match="float32 weights, got torch.bfloat16"):
        packed(torch.randn(2, 64).to(torch.bfloat16))


def test_prepack_supported_only_on_cpu():
    assert not prepack_supported(torch.float32, "meta")
    assert not prepack_supported(torch.int8, "cpu")


# ---- the engine with and without prepacking ----------------------------------------------------

def _logits_and_tokens(llm, prompts, n):
    from servelm import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, sp)
    return ([o.outputs[0].token_ids for o in outs],
            [o.outputs[0].logprobs[0] for o in outs])


def _fp32_prompts():
    from tests.conftest import TEXT_PROMPTS

    return TEXT_PROMPTS + [" ".join(TEXT_PROMPTS) * 6]  # a few hundred tokens too


@pytest.fixture(scope="module")
def plain_fp32():
    """Plain F.linear's greedy tokens and first-step logprobs, once for the paths below."""
    from servelm import LLM

    plain = LLM(dtype="float32", kv_cache_memory=64 << 20, linear_method="torch")
    assert type(plain.engine.executor.model.lm_head) is nn.Linear
    return _logits_and_tokens(plain, _fp32_prompts(), 16)


@needs_prepack
@pytest.mark.parametrize("path", ["tiles", "onednn", "auto"])
def test_engine_fp32_fast_paths_match_plain_linear(path, plain_fp32):
    """fp32 on the CPU: the linear layers in the C++ kernels' tiles, prepacked for oneDNN,
    or as the tuner chose (the default); each gives the greedy tokens and first-step
    logprobs of plain F.linear (linear_method="torch")."""
    from servelm import LLM
    from servelm.layers.linear_methods import applies
    from servelm.quantization import TiledLinear

    fast = LLM(dtype="float32", kv_cache_memory=64 << 20, linear_method=path)
    head = fast.engine.executor.model.lm_head
    if path == "tiles":
        if not applies("tiles", nn.Linear(576, 8), torch.float32, True):
            pytest.skip("no tiled kernels on this CPU")
        assert isinstance(head, TiledLinear)
    elif path == "onednn":
        assert isinstance(head, PackedLinear)
    if path != "auto":  # the tuner may keep plain F.linear for some layers and buckets
        assert not any(type(m) is nn.Linear for m in fast.engine.executor.model.modules())
    got_tokens, got_lp = _logits_and_tokens(fast, _fp32_prompts(), 16)
    want_tokens, want_lp = plain_fp32
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp):  # first step's top-5 logprobs: same ids, same values
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        for (_, a), (_, b) in zip(g.top, w.top):
            assert abs(a - b) < 1e-3
