"""SamplingParams validation: every bad value raises ValueError naming its field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", True),
    ("max_tokens", 3.0),
    ("n", 0),
    ("n", -1),
    ("n", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 3.0),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", math.nan),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", -1),
    ("logprobs", True),
    ("min_tokens", -1),
    ("min_tokens", True),
    ("seed", True),
    ("seed", "7"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 101}),
    ("logit_bias", {5: math.nan}),
    ("structured_outputs", 42),
]


@pytest.mark.parametrize("name, value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_value_error_naming_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_defaults_construct():
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and not p.greedy
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.seed is None


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0),
    dict(temperature=1e-6),
    dict(top_p=1.0, top_k=-1, min_p=1.0),
    dict(top_k=0),
    dict(top_k=50, top_p=0.01),
    dict(repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=2.0),
    dict(max_tokens=None, min_tokens=100),
    dict(max_tokens=1, min_tokens=1),
    dict(logprobs=0),
    dict(logprobs=MAX_LOGPROBS),
    dict(seed=0),
    dict(stop=("a", "b"), stop_token_ids=(1, 2)),
    dict(temperature=2, top_p=1),  # ints are fine for float fields
    dict(logit_bias={5: -100, 7: 100.0}),
])
def test_valid_values_construct(kwargs):
    SamplingParams(**kwargs)


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(stop=None).stop_strings == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
           "logprobs"]
_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(_FIELDS), value=_ANY_VALUE)
def test_any_value_constructs_or_names_field(name, value):
    """No input crashes with anything but a ValueError that names the field."""
    try:
        SamplingParams(**{name: value})
    except ValueError as e:
        assert name in str(e)
