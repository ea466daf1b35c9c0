"""Structured outputs on the session's fp32 engine: every kind of grammar holds at temperature
> 0 and with n > 1, constrained and free requests share a batch without touching each other,
and bad specs are named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from pydantic import BaseModel, Field

from servelm import SamplingParams, StructuredOutputsParams
from servelm.engine.sampler import Sampler
from servelm.structured_outputs import GrammarError

pytest.importorskip("llguidance")


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0)
    country: str = Field(max_length=16)
    capital: bool


def _gen(llm, prompt: str, spec: StructuredOutputsParams, **kw) -> list:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 80), structured_outputs=spec, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def test_params_need_exactly_one_constraint():
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": [1]},
                {"regex": ""}, {"json": 5}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**bad)
    assert StructuredOutputsParams(json='{"type": "object"}').key() == \
        StructuredOutputsParams(json={"type": "object"}).key()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=42)
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


@pytest.mark.parametrize("spec,kind", [
    ({"regex": "[a-z"}, "regex"), ({"json": {"type": "bogus"}}, "json"),
    ({"grammar": "start: undefined_rule"}, "grammar"), ({"json": "{not json"}, "json")])
def test_bad_specs_are_named(llm, spec, kind):
    with pytest.raises(GrammarError, match=f"structured_outputs.{kind}") as e:
        llm.engine.grammars.compile(StructuredOutputsParams(**spec))
    assert e.value.kind == kind


def test_compiled_grammars_are_cached(llm):
    spec = StructuredOutputsParams(regex=r"\d+")
    grammars = llm.engine.grammars
    assert grammars.compile(spec) is grammars.compile(StructuredOutputsParams(regex=r"\d+"))
    a, b = grammars.matcher(spec), grammars.matcher(spec)
    assert a is not b  # each sample its own state


def test_json_schema_holds_when_sampling_with_n3(llm):
    # No other keys (what the official client's strict mode sends), so the object ends.
    spec = StructuredOutputsParams(json={**City.model_json_schema(),
                                         "additionalProperties": False})
    outs = _gen(llm, "Describe a city as JSON:", spec, n=3, temperature=1.0, seed=7,
                max_tokens=120)
    assert len(outs) == 3
    for o in outs:
        City.model_validate_json(o.text)  # raises unless it matches the schema
        assert o.finish_reason == "stop"
    assert len({o.text for o in outs}) > 1  # really sampled


def test_regex_choice_grammar_and_json_object(llm):
    out = _gen(llm, "A product code:", StructuredOutputsParams(regex=r"[A-Z]{3}-\d{4}"),
               temperature=0.9, seed=1)[0]
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", out.text) and out.finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    out = _gen(llm, "The capital of France is", StructuredOutputsParams(choice=choices),
               temperature=0)[0]
    assert out.text == "Paris"
    lark = 'start: "Answer: " ANSWER "."\nANSWER: "yes" | "no"'
    out = _gen(llm, "Is the sky blue?", StructuredOutputsParams(grammar=lark), temperature=0.7,
               seed=3)[0]
    assert re.fullmatch(r"Answer: (yes|no)\.", out.text)
    gbnf = 'root ::= "x" [0-9] [0-9]'
    out = _gen(llm, "Code:", StructuredOutputsParams(grammar=gbnf), temperature=0.7, seed=3)[0]
    assert re.fullmatch(r"x\d\d", out.text)
    out = _gen(llm, "Some JSON:", StructuredOutputsParams(json_object=True), temperature=0,
               max_tokens=60)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens inside the object: still a prefix of one
        assert out.text.lstrip().startswith("{")


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0].outputs[0]
    both = llm.generate(
        ["The capital of France is", "A product code:"],
        [free, SamplingParams(temperature=0, max_tokens=12,
                              structured_outputs=StructuredOutputsParams(regex=r"\d{5}"))],
        use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.token_ids
    assert re.fullmatch(r"\d{5}", both[1].outputs[0].text)
    assert not llm.engine.has_unfinished_requests()


def test_sampler_masks_only_constrained_rows(llm):
    """Uniform logits: the constrained row can only start a choice; the free row is the
    plain argmax (token 0), untouched by the other row's mask."""
    class Row:
        def __init__(self, grammar):
            self.sampling_params = SamplingParams(temperature=0)
            self.prompt_token_ids, self.output_token_ids = [1], []
            self.generator, self.grammar = None, grammar

    vocab = llm.engine.model_config.vocab_size
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    out = Sampler(llm.engine.tokenizer.eos_token_ids)(torch.zeros(2, vocab),
                                                       [Row(matcher), Row(None)])
    tok = llm.get_tokenizer()
    first = tok.decode([out.token_ids[0]])
    assert first and ("yes".startswith(first) or "no".startswith(first))
    assert out.token_ids[1] == 0


def test_masks_prefetched_during_the_forward_equal_the_sampler_own(llm):
    """MaskPrefetch (started before the forward) gives each matcher the mask allowed_mask
    computes after it; the sampler takes those rows from it, and computes rows it lacks."""
    from servelm.structured_outputs import MaskPrefetch, allowed_mask

    vocab = llm.engine.model_config.vocab_size
    specs = [StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex=r"\d+"),
             StructuredOutputsParams(json={"type": "object"})]
    matchers = [llm.engine.grammars.matcher(s) for s in specs]
    ids = llm.get_tokenizer().encode("12", add_special_tokens=False)
    assert matchers[1].consume_tokens(ids)  # one advanced past its start
    pre = MaskPrefetch(matchers[:2], vocab)
    got = [pre.get(m) for m in matchers[:2]]  # (waits: a matcher serves one thread at once)
    want = allowed_mask(matchers, vocab)
    for i in range(2):
        assert torch.equal(got[i], want[i])
    assert pre.get(matchers[2]) is None

    class Row:
        def __init__(self, grammar):
            self.sampling_params = SamplingParams(temperature=0)
            self.prompt_token_ids, self.output_token_ids = [1], []
            self.generator, self.grammar = None, grammar

    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    rows = [Row(m) for m in matchers]
    sampler = Sampler(llm.engine.tokenizer.eos_token_ids, check_grammar_after=False)
    assert sampler(logits, rows, MaskPrefetch(matchers[:2], vocab)).token_ids == \
        sampler(logits, rows).token_ids


def test_greedy_rows_checked_after_choose_what_masking_first_chooses(llm):
    """A greedy constrained row takes its argmax and computes a mask only when the grammar
    rejects it: step by step along JSON, a regex and a choice, beside a sampled constrained
    row, a free row and a row with a logit_bias, the tokens equal those of masking every
    constrained row first, and both paths are taken (tokens accepted and rejected)."""
    from servelm.structured_outputs import allowed_mask

    vocab = llm.engine.model_config.vocab_size
    eos = llm.engine.tokenizer.eos_token_ids
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {
                 "a": {"type": "string"}}, "required": ["a"]}),
             StructuredOutputsParams(regex=r"[a-z]{3,40}"),
             StructuredOutputsParams(choice=["alpha", "beta"])]

    class Row:
        def __init__(self, grammar, **kw):
            self.sampling_params = SamplingParams(**{"temperature": 0, **kw})
            self.prompt_token_ids, self.output_token_ids = [1], []
            self.grammar = grammar
            self.generator = torch.Generator().manual_seed(7) if kw.get("seed") else None

    pairs = {after: [Row(llm.engine.grammars.matcher(s)) for s in specs] + [
        Row(llm.engine.grammars.matcher(specs[1]), logit_bias={5: 3.0}),
        Row(llm.engine.grammars.matcher(specs[1]), temperature=0.8, seed=7), Row(None)]
        for after in (True, False)}
    samplers = {after: Sampler(eos, check_grammar_after=after) for after in (True, False)}
    gen = torch.Generator().manual_seed(0)
    accepted = rejected = 0
    for _ in range(12):
        logits = torch.randn(len(pairs[True]), vocab, generator=gen) * 4
        allowed = logits.argmax(-1)
        for i, row in enumerate(pairs[True][:4]):
            if not row.grammar.is_stopped():
                ok = bool(allowed_mask([row.grammar], vocab)[0][allowed[i]])
                accepted, rejected = accepted + ok, rejected + (not ok)
        out = {after: samplers[after](logits, pairs[after]).token_ids for after in pairs}
        assert out[True] == out[False]
        for after in pairs:
            for row, tok in zip(pairs[after], out[after]):
                row.output_token_ids.append(tok)
                if row.grammar is not None and not row.grammar.is_stopped():
                    assert row.grammar.consume_token(tok)
    assert accepted and rejected


def test_overlapped_masks_give_the_same_answers():
    """The engine with and without the masks computed beside the forward: the same tokens."""
    from servelm import LLM

    kw = dict(dtype="float32", kernel_tuning="off", kv_cache_memory=64 << 20)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {
        "city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city", "n"]})
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec),
              SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z ]+"))]
    prompts = ["A city as JSON:", "The capital of France is", "Say something:"]
    got = {}
    for overlap in (True, False):
        llm = LLM(overlap_grammar_masks=overlap, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[overlap] = [o.outputs[0].token_ids for o in outs]
        if outs[0].outputs[0].finish_reason == "stop":
            assert set(json.loads(outs[0].outputs[0].text)) == {"city", "n"}
    assert got[True] == got[False]


# ---- JSON that ends -------------------------------------------------------------------------


def _accepts(llm, schema: dict, text: str) -> bool:
    """Whether the JSON grammar servelm compiles for `schema` takes `text` whole."""
    m = llm.engine.grammars.matcher(StructuredOutputsParams(json=schema))
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


def test_json_is_bounded_so_that_answers_end(llm):
    """Compact whitespace, integers and numbers of at most 16 digits (numbers: 9 decimals),
    no keys beyond the listed ones: what a small model could otherwise add forever."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "x": {"type": "number"}}, "required": ["n", "x"]}
    assert _accepts(llm, schema, '{"n": 9007199254740991, "x": -0.125}')
    assert _accepts(llm, schema, '{"n": -9007199254740991, "x": 0.123456789}')
    for bad in ('{"n": 90071992547409910, "x": 1}', '{\n"n": 1, "x": 1}', '{"n":1, "x": 1}',
                '{"n": 1,  "x": 1}', '{"n": 1, "x": 0.1234567891}', '{"n": 1, "x": 1e5}',
                '{"n": 1, "x": 2, "y": 3}'):
        assert not _accepts(llm, schema, bad), bad


def test_json_bounds_keep_what_the_schema_says(llm):
    # Its own format (x-guidance), its own bounds, its own word on other keys.
    flexible = {"type": "object", "properties": {"n": {"type": "integer"}},
                "x-guidance": {"whitespace_flexible": True}}
    assert _accepts(llm, flexible, '{\n  "n": 1\n}')
    assert _accepts(llm, {"type": "integer", "minimum": 1e17}, "100000000000000001")
    assert _accepts(llm, {"type": "number", "multipleOf": 0.5}, "-1.5")
    assert _accepts(llm, {"type": "object", "properties": {"a": {"type": "integer"}},
                          "additionalProperties": True}, '{"a": 1, "b": 2}')
    # An allOf merging objects: none is closed (each would refuse the other's keys).
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"properties": {"b": {"type": "integer"}}}]}
    assert _accepts(llm, merged, '{"a": 1, "b": 2}')
    assert _accepts(llm, {"type": "object"}, '{"any": [1, {"x": null}]}')


def test_an_answer_that_looped_to_max_tokens_now_ends(llm):
    """A union of bool and int: greedy, the embedded model wrote '1000...' until max_tokens
    when digits were unbounded."""
    schema = {"type": "object", "properties": {"flag": {"anyOf": [{"type": "boolean"},
                                                                  {"type": "integer"}]}},
              "required": ["flag"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.chat([{"role": "user", "content": "A record, as JSON."}], params,
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert set(json.loads(out.text)) == {"flag"}
