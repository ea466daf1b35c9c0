"""Tool-call parsing (no model): every format read whole and streamed, the streamed pieces
adding up to the whole answer at every split of the text; the forced-call schemas."""

from __future__ import annotations

import json

import pytest

from servelm.server.tools import (CALLS, NOT_CALLS, ArrayCallsParser, HermesParser,
                                  Llama3JsonParser, MistralParser, NamedCallParser,
                                  ToolCallStream, bare_calls, forced_schema,
                                  parser_for_template, value_end)


def streamed(parser, text: str, cuts: list[int], parallel: bool = True):
    """Feed `text` in pieces ending at `cuts`, then whole and final: (content, calls) as a
    client assembles them from the deltas."""
    stream = ToolCallStream(parser, parallel)
    content, calls = "", {}
    for end, final in [*((c, False) for c in cuts), (len(text), True)]:
        piece, deltas = stream.feed(text[:end], final=final)
        content += piece
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call's header is sent once"
                call.update(id=d.id, name=d.name)
            assert call["id"] is not None, "arguments before the call's id and name"
            call["arguments"] += d.arguments
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def whole(parser, text: str, parallel: bool = True):
    parsed = parser.parse(text, final=True)
    calls = [(c.name, c.arguments) for c in parsed.calls if c.name is not None]
    return parsed.content, calls[:None if parallel else 1]


HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "C", "nested": {"a": [1, "}{]"]}}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET \\"x\\""}}\n'
              '</tool_call>')

CASES = [
    (HermesParser(), HERMES_TWO, "Let me look.",
     [("get_weather", '{"city": "Paris", "unit": "C", "nested": {"a": [1, "}{]"]}}'),
      ("get_time", '{"tz": "CET \\"x\\""}')]),
    (HermesParser(), "Just text, with a < sign and <tool_ but no call.",
     "Just text, with a < sign and <tool_ but no call.", []),
    (HermesParser(), '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>', "",
     [("late_name", '{"x": 1}')]),
    (HermesParser(), '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", "{}")]),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": {"x": 1', # cut by max_tokens
     '<tool_call>{"name": "f", "arguments": {"x": 1', []),
    (Llama3JsonParser(), '{"name": "search", "parameters": {"q": "servelm"}}; '
     '{"name": "open", "parameters": {"url": "x"}}', "",
     [("search", '{"q": "servelm"}'), ("open", '{"url": "x"}')]),
    (Llama3JsonParser(), "The answer is 4.", "The answer is 4.", []),
    (Llama3JsonParser(), '{"a": 1}', '{"a": 1}', []),  # JSON, but not a call
    (MistralParser(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "neg", "arguments": {"a": 3}}]', "",
     [("add", '{"a": 1, "b": 2}'), ("neg", '{"a": 3}')]),
    (MistralParser(), 'Sure.[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]neg[ARGS]{"a": 2}', "Sure.",
     [("add", '{"a": 1}'), ("neg", '{"a": 2}')]),
    (ArrayCallsParser(), '[{"name": "add", "parameters": {"a": 1}}, {"name": "neg", '
     '"parameters": {}}]', "", [("add", '{"a": 1}'), ("neg", "{}")]),
    (NamedCallParser("add"), '{"a": 1, "b": [2, 3]}', "", [("add", '{"a": 1, "b": [2, 3]}')]),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES,
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_answers_parse(parser, text, content, calls):
    assert whole(parser, text) == (content, calls)
    for _, args in calls:
        json.loads(args)


CUT_SHORT = 4  # streams as a call, then ends as content (below)


@pytest.mark.parametrize("parser,text,content,calls",
                         [c for i, c in enumerate(CASES) if i != CUT_SHORT],
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES) if i != CUT_SHORT])
def test_every_split_streams_the_whole_answer(parser, text, content, calls):
    for step in (1, 3, 7):
        cuts = list(range(step, len(text), step))
        assert streamed(parser, text, cuts) == (content, calls), step


def test_one_call_without_parallel_calls():
    assert whole(HermesParser(), HERMES_TWO, parallel=False)[1] == [
        ("get_weather", '{"city": "Paris", "unit": "C", "nested": {"a": [1, "}{]"]}}')]
    cuts = list(range(2, len(HERMES_TWO), 2))
    assert len(streamed(HermesParser(), HERMES_TWO, cuts, parallel=False)[1]) == 1


def test_held_back_text_is_released_when_no_call_follows():
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hi <tool", final=False) == ("Hi", [])
    assert stream.feed("Hi <toolbox>", final=False) == (" <toolbox>", [])
    assert stream.feed("Hi <toolbox> ", final=True) == (" ", [])


def test_header_goes_out_before_any_argument():
    stream = ToolCallStream(HermesParser())
    text = '<tool_call>{"name": "f", "arguments": {"x": '
    content, deltas = stream.feed(text, final=False)
    assert content == "" and len(deltas) == 1
    assert deltas[0].id.startswith("call_") and deltas[0].name == "f"
    assert deltas[0].arguments == '{"x": '
    _, more = stream.feed(text + "12}}</tool_call>", final=True)
    assert [(d.id, d.name, d.arguments) for d in more] == [(None, None, "12}")]


def test_value_end():
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('[1, [2]] x', 0) == 8
    assert value_end('"a\\"b" x', 0) == 6
    assert value_end('{"a": 1', 0) is None
    assert value_end("12, x", 0) == 2
    assert value_end("12", 0) is None  # the number may go on


def test_forced_schemas():
    fns = [{"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}, {"name": "ping"}]
    named = forced_schema(fns, "add", True)
    assert named["properties"] == {"a": {"type": "integer"}} and named["required"] == ["a"]
    assert named["additionalProperties"] is False  # unless the schema allows other keys
    assert named["x-guidance"]["whitespace_flexible"] is False
    assert forced_schema(fns, "ping", True)["properties"] == {}
    required = forced_schema(fns, None, parallel=False)
    assert required["type"] == "array" and required["minItems"] == 1
    assert required["maxItems"] == 1
    assert [i["properties"]["name"] for i in required["items"]["anyOf"]] == [
        {"const": "add"}, {"const": "ping"}]
    assert "maxItems" not in forced_schema(fns, None, parallel=True)


def test_parser_from_template_or_flag():
    assert parser_for_template("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("auto", None).name == "hermes"
    assert parser_for_template("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("auto", "[TOOL_CALLS]").name == "mistral"
    assert parser_for_template("mistral", "<tool_call>").name == "mistral"
    with pytest.raises(ValueError, match="tool call parser must be one of"):
        parser_for_template("xml", None)


def test_call_ids_suit_the_template():
    assert HermesParser().new_call_id().startswith("call_")
    ids = {MistralParser().new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)  # its template's rule
    stream = ToolCallStream(MistralParser())
    _, (delta,) = stream.feed('[TOOL_CALLS]f[ARGS]{"a": 1}', final=True)
    assert len(delta.id) == 9


def test_a_call_cut_short_streams_its_start_then_ends_as_content():
    """max_tokens ends a call midway: what streamed of it stays, and, as in the whole
    answer, the text is content (no complete call was made)."""
    parser, text, content, calls = CASES[CUT_SHORT]
    assert calls == [] and content == text
    content, calls = streamed(parser, text, list(range(5, len(text), 5)))
    assert content == text
    (name, args), = calls
    assert name == "f" and '{"x": 1'.startswith(args) and args


# ---- bare calls: the whole answer a call object or an array, as small Qwen models write them --

TOOL_NAMES = ["get_weather", "get_time"]
WEATHER = '{"city": "Paris"}'
BARE = [  # (answer, the calls it holds: [] means it is content)
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", WEATHER)]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     [("get_weather", '{\n    "city": "Paris"\n  }')]),
    ('  [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"parameters": {"tz": "CET"}, '
     '"name": "get_time"}]\n', [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
     [("get_weather", WEATHER)]),
    ('```\n{"name": "get_time", "arguments": {}}\n```', [("get_time", "{}")]),
    ('{"name": "get_news", "arguments": {"city": "Paris"}}', []),           # not a tool offered
    ('[{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]', []),
    ('{"city": "Paris"}', []),                                              # JSON, not a call
    ('{"name": "get_weather"}', []),                                        # no arguments
    ('{"name": "get_weather", "arguments": [1]}', []),
    ('{"name": "get_weather", "arguments": "Paris"}', []),                  # a string, not JSON
    ('{"name": "get_weather", "arguments": {}, "id": 1}', []),              # another key
    ('{"name": "get_weather", "arguments": {}}\nThat is the call.', []),    # more than a call
    ("{x} is the set holding only x.", []),
    ('```python\nprint({"name": 1})\n```', []),
    ("[]", []),
]


@pytest.mark.parametrize("text,calls", BARE, ids=[f"bare-{i}" for i in range(len(BARE))])
def test_bare_calls_parse_whole_and_streamed(text, calls):
    parser = HermesParser().for_tools(TOOL_NAMES)
    content = "" if calls else text
    assert whole(parser, text) == (content, calls)
    for step in (1, 4):
        assert streamed(parser, text, list(range(step, len(text), step))) == (content, calls)


def test_bare_calls_need_the_requests_tools():
    """Without the request's tool names (a parser not made for a request) JSON stays text."""
    text = BARE[0][0]
    assert whole(HermesParser(), text) == (text, [])
    assert whole(HermesParser().for_tools(["other"]), text) == (text, [])
    assert MistralParser().for_tools(TOOL_NAMES).name == "mistral"


@pytest.mark.parametrize("text,calls", [c for c in BARE if c[1]],
                         ids=[f"bare-{i}" for i, c in enumerate(BARE) if c[1]])
def test_a_bare_call_streams_nothing_until_it_is_the_whole_answer(text, calls):
    """Every prefix of a call is held back whole: no content leaks out of it, and the call
    goes out with the last step, when nothing more can follow it."""
    stream = ToolCallStream(HermesParser().for_tools(TOOL_NAMES))
    for end in range(len(text) + 1):
        assert stream.feed(text[:end], final=False) == ("", []), text[:end]
    content, deltas = stream.feed(text, final=True)
    assert content == "" and [d.name for d in deltas if d.id] == [n for n, _ in calls]


def test_text_opening_like_a_call_is_released_once_it_cannot_be_one():
    stream = ToolCallStream(HermesParser().for_tools(TOOL_NAMES))
    assert stream.feed("{", final=False) == ("", [])
    assert stream.feed('{"na', final=False) == ("", [])
    assert stream.feed('{"name": "get_w', final=False) == ("", [])
    assert stream.feed('{"name": "get_x', final=False) == ('{"name": "get_x', [])
    assert stream.feed('{"name": "get_x", "a', final=True) == ('", "a', [])
    stream = ToolCallStream(HermesParser().for_tools(TOOL_NAMES))
    assert stream.feed("``", final=False) == ("", [])
    assert stream.feed("```js", final=False) == ("", [])
    assert stream.feed("```js\n", final=False) == ("```js", [])  # trailing whitespace held
    stream = ToolCallStream(HermesParser().for_tools(TOOL_NAMES))
    assert stream.feed("{x} is", final=False) == ("{x} is", [])
    # A complete call, then more text: content after all, never a call.
    stream = ToolCallStream(HermesParser().for_tools(TOOL_NAMES))
    text = BARE[0][0]
    assert stream.feed(text + "\n", final=False) == ("", [])
    assert stream.feed(text + "\nDone", final=True) == (text + "\nDone", [])


def test_a_bare_call_cut_short_is_content():
    text = BARE[0][0][:-3]
    parser = HermesParser().for_tools(TOOL_NAMES)
    assert whole(parser, text) == (text, [])
    assert streamed(parser, text, list(range(1, len(text)))) == (text, [])


def test_bare_call_verdicts_never_go_back_on_not_calls():
    """Once a text cannot be a call no longer one can: released content is never taken back."""
    texts = [t for t, _ in BARE] + ['{"x\\u0041": 1}', '{"name": "get\\u005fweather", "a',
                                    '```jsonx {}', '{"name": "get_weather", "arguments": {}} x']
    for text in texts:
        verdicts = [bare_calls(text[:end], frozenset(TOOL_NAMES))[0]
                    for end in range(len(text) + 1)]
        if NOT_CALLS in verdicts:
            first = verdicts.index(NOT_CALLS)
            assert set(verdicts[first:]) == {NOT_CALLS}, (text, verdicts)
    assert bare_calls('{"name": "get\\u005fweather", "arguments": {}}',
                      frozenset(TOOL_NAMES))[0] == CALLS  # an escape spelling a tool's name


def test_tagged_calls_still_parse_with_the_requests_tools():
    parser = HermesParser().for_tools(TOOL_NAMES)
    assert whole(parser, HERMES_TWO) == whole(HermesParser(), HERMES_TWO)
    cuts = list(range(3, len(HERMES_TWO), 3))
    assert streamed(parser, HERMES_TWO, cuts) == whole(HermesParser(), HERMES_TWO)
