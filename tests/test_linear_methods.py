"""The linear methods' registry and the weight formats (servelm.layers.linear_methods): the
registry keeps the order and flags the tuner reads, a format's methods are exactly those
that apply, a format's name (the tuner's cache keys) never changes, and the CLI's choices
are the registry's names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm import config
from servelm import quantization as Q
from servelm.layers import linear_methods as lm

# The constants as they stood before the registry: the tuner, its cached table and the CLI
# depend on this order and these flags.
WANT_METHODS = ("tiles", "onednn", "qdot", "int4pack", "int8pack", "gemv", "gemv_rows",
                "panels", "q8act", "bfp", "amx", "w8a8", "w8a8_pairs", "w8a8_amx", "torch")
WANT_BF16_INSIDE = ("int4pack",)
WANT_DEQUANTISED = ("onednn", "amx", "w8a8", "w8a8_pairs", "w8a8_amx")


torch.manual_seed(0)
_LIN = nn.Linear(128, 96)  # the quantised sources' weights


def _sources() -> dict[str, nn.Module]:
    lin = _LIN
    return {
        "float32": nn.Linear(128, 96),
        "bfloat16": nn.Linear(128, 96).to(torch.bfloat16),
        "float16": nn.Linear(128, 96).half(),
        "int8": Q.quantize_linear(lin, "int8"),
        "int4g32": Q.quantize_linear(lin, "int4", group_size=32),
        "int4g64": Q.quantize_linear(lin, "int4", group_size=64),
    }


SOURCES = _sources()


def test_registry_keeps_the_order_and_flags():
    assert lm.METHODS == WANT_METHODS
    assert tuple(m.name for m in lm.LINEAR_METHODS) == WANT_METHODS
    assert tuple(lm.METHODS_BY_NAME) == WANT_METHODS
    assert lm.BF16_INSIDE == WANT_BF16_INSIDE
    assert lm.DEQUANTISED == WANT_DEQUANTISED
    for m in lm.LINEAR_METHODS:
        assert m.bf16_inside == (m.name in WANT_BF16_INSIDE)
        assert m.dequantised == (m.name in WANT_DEQUANTISED)
        assert lm.by_name(m.name) is m
    assert not lm.tunable("int4pack", torch.float32) and lm.tunable("int4pack", torch.bfloat16)


def test_unknown_method_is_a_value_error():
    src = SOURCES["float32"]
    for call in (lambda: lm.applies("nope", src, torch.float32, True),
                 lambda: lm.build("nope", src, torch.float32),
                 lambda: lm.tunable("nope", torch.float32)):
        with pytest.raises(ValueError, match="unknown linear method 'nope'; one of tiles"):
            call()


def test_format_names_are_the_cache_keys():
    for name, src in SOURCES.items():
        fmt = lm.WeightFormat.of(src)
        assert fmt.name == name == lm.weight_format(src)
        assert fmt.quantised == name.startswith("int")
    assert lm.WeightFormat.of(SOURCES["int4g64"]) == lm.WeightFormat("int4", 64)
    with pytest.raises(TypeError, match="not a linear layer source"):
        lm.WeightFormat.of(nn.ReLU())


@pytest.mark.parametrize("name", list(SOURCES))
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False])
def test_format_methods_are_those_that_apply(name, act, kernels):
    src = SOURCES[name]
    got = lm.WeightFormat.of(src).methods(src, act, kernels)
    assert got == [m for m in lm.METHODS if lm.applies(m, src, act, kernels)]
    assert got[-1] == "torch"  # the reference runs everything
    if not kernels:
        assert got == ["torch"]
    assert lm.default_method(src, act, kernels) in got


@pytest.mark.parametrize("name", list(SOURCES))
def test_format_reference_and_head(name):
    src = SOURCES[name]
    fmt = lm.WeightFormat.of(src)
    ref = fmt.reference(src)
    assert ref.dtype == torch.float32 and ref.shape == (96, 128)
    assert torch.equal(lm.reference_weight(src), ref)
    if fmt.quantised:  # the dequantised weights, within the quantisation's error
        w = _LIN.weight.detach()
        assert (ref - w).abs().max() < 0.1 * w.abs().max()
    h = lm.head(src, 32)
    assert lm.WeightFormat.of(h) == fmt and h.out_features == 32
    assert torch.equal(fmt.reference(h), ref[:32])
    assert torch.equal(h.bias.float(), src.bias[:32].float())
    with pytest.raises(ValueError, match="multiple of 16"):
        fmt.head(src, 20)


def test_cli_choices_are_the_registry_names():
    # config sits at the bottom of the import layering and cannot import the registry: the
    # two lists are kept equal here.
    assert config.LINEAR_METHODS == ("auto",) + lm.METHODS
