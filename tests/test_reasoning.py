"""Reasoning models: the thought split from the answer (servelm.server.reasoning).

The splitter at every chunk boundary of texts with and without thoughts, both parsers,
the parser chosen from templates, Qwen3's real template switching thinking off, tool calls
read after a thought, structured outputs behind the thought; then a real server: the
embedded model made to think by a ChatML template whose generation prompt opens `<think>`
(DeepSeek-R1 style) and a few-shot conversation whose greedy continuation closes it.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from servelm.models.loader import resolve_model_path
from servelm.server import chat, tools
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.reasoning import ReasoningParser, parser_for_template
from servelm.server.serving import Prepared
from servelm.server.tools import HermesParser, ToolCallStream
from servelm.structured_outputs import GrammarCompiler, StructuredOutputsParams
from servelm.tokenizer import load_tokenizer
from test_server import MODEL, Server

QWEN3 = parser_for_template("qwen3", None)
R1 = parser_for_template("deepseek_r1", None)
GPTOSS = parser_for_template("openai_gptoss", None)
A, F, E, S = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|end|>",
              "<|start|>assistant")

# (parser, answer, (reasoning, content))
CASES = [
    (QWEN3, "<think>\nLet me see: 2 + 2.\n</think>\n\nThe answer is 4.",
     ("Let me see: 2 + 2.", "The answer is 4.")),
    (QWEN3, "No thought: a < b, </thin <b>x</b>", (None, "No thought: a < b, </thin <b>x</b>")),
    (QWEN3, "<think>\nOnly a thought, cut short <", ("Only a thought, cut short <", "")),
    (QWEN3, "<think>\nunfinished </thin", ("unfinished </thin", "")),
    (QWEN3, "Well. <think>x < y\n</think>\nDone", ("x < y", "Well. Done")),
    (QWEN3, "<think>a</think>b <think>c</think>", ("a", "b <think>c</think>")),
    (QWEN3, "<think>\n\n</think>\n\nHi", (None, "Hi")),
    (QWEN3, "<thinking>not a tag</thinking>", (None, "<thinking>not a tag</thinking>")),
    (QWEN3, "", (None, "")),
    (R1, "Okay, 2 + 2.\n\n</think>\n\n4", ("Okay, 2 + 2.", "4")),
    (R1, "<think>\nOkay \n</think>4 </think>", ("Okay", "4 </think>")),
    (R1, "Still thinking at max_tokens\n", ("Still thinking at max_tokens", "")),
    (R1, "a  \n b\n</think>", ("a  \n b", "")),
    (R1, "x <think> y</think>z", ("x <think> y", "z")),
    (R1, "", (None, "")),
    # gpt-oss's harmony messages (read with their special tokens)
    (GPTOSS, f"{A}User asks 2 + 2.{E}{S}{F}4<|return|>", ("User asks 2 + 2.", "4")),
    (GPTOSS, f"{F}Hello <b>x</b>!<|return|>", (None, "Hello <b>x</b>!")),
    (GPTOSS, f"{A}Cut short at max_tokens <|", ("Cut short at max_tokens <|", "")),
    (GPTOSS, f"  \n{A}a{E}{S}<|channel|>commentary<|message|>Checking.{E}{S}{F}b",
     ("a", "Checking.b")),
    (GPTOSS, '<|channel|>final <|constrain|>json<|message|>{"a": 1}<|return|>',
     (None, '{"a": 1}')),
    (GPTOSS, f"{A}no end{S}{F}yes", ("no end", "yes")),  # the next header opens the next one
    (GPTOSS, "Plain text <|end|> from a model off its format", (None, "Plain text <|end|> "
                                                                      "from a model off its format")),
    (GPTOSS, f"{A}", (None, "")),
    (GPTOSS, "", (None, "")),
]


def _split_every_way(parser: ReasoningParser, text: str):
    """Every way of cutting `text` into up to three deltas, and one character at a time."""
    cuts = [[text]]
    cuts += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
             for j in range(i, len(text) + 1)]
    cuts.append(list(text))
    for deltas in cuts:
        s = parser.stream()
        pieces = [s.feed(d) for d in deltas] + [s.finish()]
        yield deltas, pieces


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_split_at_every_chunk_boundary(parser, text, expected):
    assert parser.split(text) == expected
    reasoning, content = expected
    for deltas, pieces in _split_every_way(parser, text):
        got_r = "".join(r for r, _ in pieces)
        got_c = "".join(c for _, c in pieces)
        assert (got_r or None, got_c) == expected, deltas
        for tag in ("<think>", "</think>"):
            # a tag is never sent in pieces: either whole in the text, or not at all
            assert got_r.count(tag) == (reasoning or "").count(tag), deltas
            assert got_c.count(tag) == content.count(tag), deltas


def test_the_prompt_says_where_the_answer_starts():
    opened = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold<|im_end|>\n<|im_start|>user\nq"
    assert QWEN3.for_prompt(opened).split("hmm</think>Hi") == ("hmm", "Hi")
    assert QWEN3.for_prompt(opened).split("hmm") == ("hmm", "")
    assert QWEN3.for_prompt(closed).split("Hi") == (None, "Hi")
    assert R1.for_prompt(closed).split("Hi") == (None, "Hi")
    assert R1.for_prompt(history + "<|im_start|>assistant\n").split("hmm") == ("hmm", "")
    assert QWEN3.for_prompt(history + "<|im_start|>assistant\n").split("Hi") == (None, "Hi")
    assert QWEN3.for_prompt(opened).thinks_first and not QWEN3.thinks_first


# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json), as the model ships it.
with open(os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")) as f:
    QWEN3_TEMPLATE = f.read()

# DeepSeek-R1 distills' first template's end: past turns lose their thought, no <think> opened.
R1_OLD_TEMPLATE = ("{% for m in messages %}{% set content = m['content'] %}"
                   "{% if '</think>' in content %}{% set content = content.split('</think>')[-1]"
                   " %}{% endif %}{{ '<｜' + m['role'] + '｜>' + content }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path(None))


# gpt-oss's template's generation prompt and the channel it names (the harmony format).
HARMONY_TEMPLATE = ("{% for m in messages %}{{ '<|start|>' + m.role + '<|message|>' + m.content "
                    "+ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}"
                    "{{ '<|start|>assistant' }}{% endif %}{# <|channel|>final #}")


def test_auto_picks_from_the_template(tok):
    assert parser_for_template("auto", HARMONY_TEMPLATE).name == "openai_gptoss"
    assert parser_for_template("auto", QWEN3_TEMPLATE).name == "qwen3"
    assert parser_for_template("auto", R1_OLD_TEMPLATE).name == "deepseek_r1"
    assert parser_for_template("auto", tok.chat_template) is None  # SmolLM2's ChatML
    assert parser_for_template("auto", None) is None
    assert parser_for_template("none", QWEN3_TEMPLATE) is None
    assert parser_for_template("deepseek_r1", tok.chat_template).name == "deepseek_r1"
    with pytest.raises(ValueError, match="qwen3"):
        parser_for_template("qwen", None)


def test_enable_thinking_false_reaches_qwen3_template(tok):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    off = ChatCompletionRequest(model="m", messages=messages,
                                chat_template_kwargs={"enable_thinking": False})
    effort = ChatCompletionRequest(model="m", messages=messages, reasoning_effort="none")
    on = ChatCompletionRequest(model="m", messages=messages)
    rendered = {name: tok.apply_chat_template(messages, chat_template=QWEN3_TEMPLATE,
                                              template_kwargs=r.template_kwargs())
                for name, r in (("off", off), ("effort", effort), ("on", on))}
    assert rendered["off"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered["effort"] == rendered["off"]
    assert rendered["on"].endswith("<|im_start|>assistant\n")
    qwen3 = parser_for_template("auto", QWEN3_TEMPLATE)
    # thinking off: even an answer that writes the tags is the answer
    assert qwen3.for_prompt(rendered["off"]).split("4") == (None, "4")
    assert qwen3.for_prompt(rendered["on"]).split("<think>\n2+2\n</think>\n\n4") == ("2+2", "4")
    # a past turn's thought is dropped by the template as it renders history
    past = messages + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4"},
                       {"role": "user", "content": "And 3 + 3?"}]
    assert "hmm" not in tok.apply_chat_template(past, chat_template=QWEN3_TEMPLATE)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_come_from_the_answer_only():
    """A thought that mentions a call is not one; the call after it is (hermes parser)."""
    parser = HermesParser().for_tools(["get_weather"])
    text = ('<think>\nMaybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            f"\n</tool_call> no: Paris.\n</think>\n\n{CALL}")
    thought = 'Maybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' \
              "\n</tool_call> no: Paris."
    prepared = Prepared([], None, {}, parser, True, QWEN3)
    message, finish = chat._message(prepared, text, "stop")
    assert finish == "tool_calls" and message.content is None
    assert message.reasoning_content == message.reasoning == thought
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    # streamed, at every two-way cut: the same thought, one call, no content
    for i in range(len(text) + 1):
        stream, calls = chat._Thought(QWEN3.stream()), ToolCallStream(parser)
        reasoning, args, names = "", "", []
        for k, delta in enumerate((text[:i], text[i:])):
            r, _ = stream.feed(delta, final=k == 1)
            reasoning += r
            content, pieces = calls.feed(stream.answer, final=k == 1)
            assert not content
            names += [p.name for p in pieces if p.name]
            args += "".join(p.arguments or "" for p in pieces)
        assert (reasoning, names, json.loads(args)) == (thought, ["get_weather"],
                                                        {"city": "Paris"}), i


def test_harmony_tool_calls_come_from_the_function_messages():
    """gpt-oss: a commentary message to functions.NAME is a call (the openai tool parser
    reading what the harmony reasoning parser passes on), the analysis before it the thought;
    two calls in one answer; whole and at every two-way cut of the stream."""
    from servelm.server.tools import OpenAIParser

    parser = OpenAIParser()
    assert tools.parser_for_template("auto", HARMONY_TEMPLATE).name == "openai"
    text = (f"{A}Need the weather; to=functions.x is not a call here.{E}"
            f"{S}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>'
            f"{S} to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Rome"}<|call|>')
    thought = "Need the weather; to=functions.x is not a call here."
    want = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    prepared = Prepared([], None, {}, parser, True, GPTOSS)
    message, finish = chat._message(prepared, text, "stop")
    assert finish == "tool_calls" and message.content is None
    assert message.reasoning_content == thought
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == want
    for i in range(len(text) + 1):
        stream, calls = chat._Thought(GPTOSS.stream()), ToolCallStream(parser)
        reasoning, args, names = "", {}, []
        for k, delta in enumerate((text[:i], text[i:])):
            r, _ = stream.feed(delta, final=k == 1)
            reasoning += r
            content, pieces = calls.feed(stream.answer, final=k == 1)
            assert not content, i
            names += [p.name for p in pieces if p.name]
            for p in pieces:
                args[p.index] = args.get(p.index, "") + (p.arguments or "")
        assert reasoning == thought, i
        assert [(n, json.loads(args[k])) for k, n in enumerate(names)] == want, i
    # no call: the final message is the content; a call cut short is content at the end
    assert chat._message(prepared, f"{A}hm{E}{S}{F}Sunny.", "stop")[0].content == "Sunny."
    cut = chat._message(prepared, f"{S}<|channel|>commentary to=functions.f<|message|>{{", "length")
    assert not cut[0].tool_calls and cut[0].content == "to=functions.f<|message|>{"


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarCompiler(tok, len(tok._backend.get_vocab()))


def _accepts(grammars, tok, spec: StructuredOutputsParams, text: str) -> bool:
    m = grammars.matcher(spec)
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_structured_outputs_apply_after_the_thought(grammars, tok):
    schema = {"type": "object", "properties": {"reply": {"enum": ["hi", "bye"]}},
              "required": ["reply"], "additionalProperties": False}
    thinking = R1.answer_grammar(StructuredOutputsParams(json=schema))
    assert _accepts(grammars, tok, thinking, 'Say hi, {"x"} is wrong.</think>\n\n{"reply": "hi"}')
    assert not _accepts(grammars, tok, thinking, 'Hmm.</think>\n\n{"reply": "yo"}')
    assert not _accepts(grammars, tok, thinking, '{"reply": "hi"}')  # no thought closed
    optional = QWEN3.answer_grammar(StructuredOutputsParams(regex=r"[0-9]+/[0-9]+"))
    assert _accepts(grammars, tok, optional, "<think>\n1/2 of 4</think>\n2/4")
    assert _accepts(grammars, tok, optional, "2/4")
    assert not _accepts(grammars, tok, optional, "<think>x</think>four")
    choice = R1.answer_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    assert _accepts(grammars, tok, choice, "yes or no?</think>no")
    with pytest.raises(ValueError, match="grammar"):
        R1.answer_grammar(StructuredOutputsParams(grammar='start: "a"'))
    with pytest.raises(ValueError, match="harmony"):
        GPTOSS.answer_grammar(StructuredOutputsParams(choice=["yes", "no"]))


def test_harmony_answers_keep_their_special_tokens(tok):
    """The harmony parser reads the message tags, special tokens that answers otherwise
    lose: a chat request under it keeps them in the text; the others skip them."""
    from types import SimpleNamespace

    engine = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(max_model_len=2048))
    ctx = SimpleNamespace(engine=engine, reasoning_parser=GPTOSS, tool_parser=None)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                chat_template=HARMONY_TEMPLATE)
    prepared = chat.prepare(ctx, req)
    assert prepared.params.skip_special_tokens is False
    assert prepared.reasoning_parser.split(f"{A}x{E}{S}{F}y") == ("x", "y")
    plain = chat.prepare(SimpleNamespace(**{**vars(ctx), "reasoning_parser": QWEN3}), req)
    assert plain.params.skip_special_tokens is True


# ---- a real server: the embedded model made to think ------------------------------------------

# ChatML whose generation prompt opens a thought (DeepSeek-R1 style), closed at once when
# enable_thinking is false (Qwen3 style).
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and "
            "enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}"
            "{{ '<think>\\n' }}{% endif %}{% endif %}")
THOUGHT = "The user greets me."
# Three worked turns, thought then answer: greedy decoding copies the pattern, </think> included.
SHOTS = [{"role": "system", "content": "You are a helpful assistant."}] + [
    m for _ in range(3) for m in (
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>\n\nHi!"})]
GREET = SHOTS + [{"role": "user", "content": "Say hi"}]
TOOL_THOUGHT = "I need the weather."
TOOL_SHOTS = [m for _ in range(3) for m in (
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": f"<think>\n{TOOL_THOUGHT}\n</think>\n\n{CALL}"})]
ASK_WEATHER = TOOL_SHOTS + [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = Server("--chat-template", TEMPLATE, "--reasoning-parser", "deepseek_r1",
               "--kernel-tuning", "off")
    yield s.wait_ready(timeout=300)  # a loaded machine starts it slowly
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(client, **kw) -> tuple[str | None, str | None, list, str]:
    """(reasoning, content, tool-call deltas, finish_reason) of a streamed answer, deltas
    joined; reasoning and reasoning_content must agree in every chunk."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            assert getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None)
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            calls += d.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def _whole_and_streamed(client, **kw):
    """The answer whole and streamed (_streamed's tuple), asked at once: one batch, not two
    answers one after the other (the same greedy prompt twice in a step)."""
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_streamed, client, **kw)
        return client.chat.completions.create(**kw), streamed.result()


def _thought(message) -> str | None:
    assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)
    return getattr(message, "reasoning_content", None)


def test_served_thought_and_answer(client):
    kw = dict(model=MODEL, messages=GREET, temperature=0, max_tokens=30)
    r, streamed = _whole_and_streamed(client, **kw)
    msg = r.choices[0].message
    assert (_thought(msg), msg.content, r.choices[0].finish_reason) == (THOUGHT, "Hi!", "stop")
    assert streamed == (THOUGHT, "Hi!", [], "stop")


def test_served_unfinished_thought_is_all_reasoning(client, server):
    kw = dict(model=MODEL, messages=GREET[-1:], temperature=0, max_tokens=6)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "length"
    # the same prompt as a plain completion: its text is the thought, stripped
    prompt = ("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    raw = client.completions.create(model=kw["model"], prompt=prompt, temperature=0,
                                    max_tokens=6).choices[0].text
    assert "</think>" not in raw and _thought(msg) == raw.strip()
    assert _streamed(client, **kw) == (raw.strip(), None, [], "length")


def test_served_thinking_off_is_all_answer(client):
    kw = dict(model=MODEL, messages=GREET, temperature=0, max_tokens=10,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert _thought(msg) is None and msg.content
    assert _streamed(client, **kw) == (None, msg.content, [], r.choices[0].finish_reason)


def test_served_tool_call_after_a_thought(client):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
              temperature=0, max_tokens=60)
    r, (reasoning, content, calls, finish) = _whole_and_streamed(client, **kw)
    msg = r.choices[0].message
    assert _thought(msg) == TOOL_THOUGHT and not msg.content
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert (reasoning, content, finish) == (TOOL_THOUGHT, None, "tool_calls")
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


def test_served_json_answer_after_the_thought(client):
    schema = {"type": "object", "properties": {"reply": {"enum": ["hi", "bye"]}},
              "required": ["reply"], "additionalProperties": False}
    kw = dict(model=MODEL, messages=GREET, temperature=0, max_tokens=40,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "r", "schema": schema}})
    r, streamed = _whole_and_streamed(client, **kw)
    msg = r.choices[0].message
    assert _thought(msg) == THOUGHT and json.loads(msg.content) in ({"reply": "hi"},
                                                                    {"reply": "bye"})
    assert streamed == (THOUGHT, msg.content, [], r.choices[0].finish_reason)


def test_served_grammar_behind_a_thought_is_refused(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=GREET, max_tokens=5,
            extra_body={"structured_outputs": {"grammar": 'start: "a"'}})
    err = e.value.body
    assert err["param"] == "structured_outputs" and "thought" in err["message"]
    # still serving, and a completion (no chat template, no parser) is untouched
    ok = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": "</think>Hi", "max_tokens": 2})
    assert ok.status_code == 200 and "reasoning_content" not in ok.json()["choices"][0]
