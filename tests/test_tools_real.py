"""Tool calls as a real model writes them, and /tokenize with tools.

Qwen2.5-Coder-0.5B (greedy, under tool_choice "auto") answers some questions with a bare JSON
call instead of a <tool_call> tag: one `servelm serve` process on it shows those answers come
back as tool_calls, streamed and not. /tokenize with tools is checked against the chat route's
own rendering (chat.prepare, no engine) on the embedded model, whose template does not render
tools (servelm describes them), and on Qwen's, which does, then against the served chat."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from servelm.server import chat
from servelm.server.errors import APIError
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.serving import ServingContext
from servelm.server.tokenize import TokenizeRequest, tokenize
from servelm.server.tools import HermesParser
from servelm.tokenizer import load_tokenizer
from test_server import Server, sse_events

_spec = importlib.util.spec_from_file_location(
    "fetch_models", Path(__file__).parents[1] / "scripts" / "fetch_models.py")
fetch_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_models)

QWEN = "qwen25-coder-0.5b"
SERVED = "qwen-coder"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city name"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}}
# The question -> Qwen2.5-Coder-0.5B's greedy answer with WEATHER offered (fp32): a bare call,
# and one in a ```json fence.
RECORDED = {
    "What is the weather like in Paris today?":
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "What's the weather in Paris?":
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
}


def _qwen_path() -> str:
    path = fetch_models.model_path(QWEN)
    if not path.is_file():
        pytest.skip(f"{QWEN} is not fetched: python scripts/fetch_models.py {QWEN}")
    return str(path)


def _ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


# ---- /tokenize renders tools as the chat route does (no engine) ------------------------------


def _context(tok) -> ServingContext:
    engine = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(max_model_len=4096))
    return ServingContext(engine, metrics=None, model_name="m", tool_parser=HermesParser())


def _chat_prefill(ctx: ServingContext, messages: list[dict], tools: list[dict]) -> list[int]:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                "tools": tools})
    ((_, ids),) = chat.prepare(ctx, req).prompts
    return ids


@functools.cache
def _tokenizer(path: str):
    """One load a file for the module (the tokenizer is only read)."""
    return load_tokenizer(path)


@pytest.fixture(scope="module", params=["embedded", QWEN])
def tokenizer(request, gguf_path):
    return _tokenizer(gguf_path if request.param == "embedded" else _qwen_path())


def test_tokenize_with_tools_is_the_chat_routes_prefill(tokenizer):
    ctx = _context(tokenizer)
    history = [{"role": "system", "content": "Be brief."}, *_ask("Weather in Oslo?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    for messages in (_ask("Weather in Oslo?"), history):
        body = {"messages": messages, "tools": [WEATHER, TIME]}
        got = tokenize(ctx, TokenizeRequest.model_validate(body))
        assert got.tokens == _chat_prefill(ctx, messages, [WEATHER, TIME])
        assert got.count == len(got.tokens)
        text = tokenizer.decode(got.tokens, skip_special_tokens=False)
        assert "get_time" in text and "Get the current weather in a city." in text
    untold = tokenize(ctx, TokenizeRequest.model_validate({"messages": _ask("Weather in Oslo?")}))
    assert "get_time" not in tokenizer.decode(untold.tokens, skip_special_tokens=False)
    no_prompt = tokenize(ctx, TokenizeRequest.model_validate(
        {"messages": _ask("Hi"), "tools": [WEATHER], "add_generation_prompt": False}))
    with_prompt = tokenize(ctx, TokenizeRequest.model_validate(
        {"messages": _ask("Hi"), "tools": [WEATHER]}))
    assert with_prompt.tokens[:no_prompt.count] == no_prompt.tokens
    assert with_prompt.count > no_prompt.count


def test_tool_choice_none_after_a_call_renders_the_history(tokenizer):
    """tool_choice "none" leaves the tools out of the prompt, but the history's earlier call
    is still written out (a template that renders no tools cannot take tool_calls)."""
    ctx = _context(tokenizer)
    messages = [*_ask("Weather in Oslo?"),
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                "tools": [WEATHER], "tool_choice": "none"})
    ((_, ids),) = chat.prepare(ctx, req).prompts
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "Oslo" in text and "-3 C" in text and "Get the current weather" not in text
    got = tokenize(ctx, TokenizeRequest.model_validate({"messages": messages}))
    assert got.tokens == ids


def test_tokenize_tools_need_messages(tokenizer):
    with pytest.raises(APIError) as e:
        tokenize(_context(tokenizer), TokenizeRequest.model_validate(
            {"prompt": "Hi", "tools": [WEATHER]}))
    assert e.value.status == 400 and e.value.param == "tools"
    with pytest.raises(ValueError, match="tool_choice"):  # as in vLLM, tools only
        TokenizeRequest.model_validate({"messages": _ask("Hi"), "tools": [WEATHER],
                                        "tool_choice": "auto"})


# ---- the served Qwen model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = Server("--model", _qwen_path(), "--served-model-name", SERVED, "--kernel-tuning", "off")
    yield s.wait_ready(timeout=300)
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return _tokenizer(_qwen_path())


def test_served_tokenize_with_tools_is_what_chat_prefills(server, client, qwen_tokenizer):
    messages = _ask("What is the weather like in Paris today?")
    body = {"model": SERVED, "messages": messages, "tools": [WEATHER]}
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tok = qwen_tokenizer
    expected = tok.encode(tok.apply_chat_template(messages, tools=[WEATHER]),
                          add_special_tokens=False)
    assert r.json()["tokens"] == expected
    answer = client.chat.completions.create(model=SERVED, messages=messages, tools=[WEATHER],
                                            max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens == len(expected)
    r = httpx.post(f"{server.url}/tokenize", json={**body, "tool_choice": "auto"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("question,stream", [(q, q == list(RECORDED)[1]) for q in RECORDED],
                         ids=["bare", "fenced-streamed"])
def test_real_bare_json_calls_come_back_as_tool_calls(server, client, qwen_tokenizer, question,
                                                     stream):
    """The bare call answered whole, the fenced one streamed (each answer is a few seconds
    of fp32 decoding: the parser's stream and whole paths meet both shapes in test_tools).
    The answer's logprobs spell the model's own text, the call as it wrote it: one answer
    shows both what the model wrote and what the chat route made of it."""
    messages = _ask(question)
    eos = {qwen_tokenizer.token_text(i) for i in qwen_tokenizer.eos_token_ids}

    def assert_model_wrote(tokens: list[str]) -> None:
        # The recorded text, no tags, then the end of the turn (not max_tokens).
        assert "".join(tokens[:-1]) == RECORDED[question] and tokens[-1] in eos, tokens

    if not stream:
        whole = client.chat.completions.create(model=SERVED, messages=messages, logprobs=True,
                                               tools=[WEATHER], max_tokens=60, temperature=0)
        choice = whole.choices[0]
        assert_model_wrote([c.token for c in choice.logprobs.content])
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        return
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": SERVED, "messages": messages, "tools": [WEATHER], "max_tokens": 60,
        "temperature": 0, "stream": True, "logprobs": True})
    deltas = [c["choices"][0] for c in sse_events(r.text.splitlines()) if c["choices"]]
    assert_model_wrote([e["token"] for d in deltas if d.get("logprobs")
                        for e in d["logprobs"]["content"]])
    assert not "".join(d["delta"].get("content") or "" for d in deltas)  # nothing leaked
    pieces = [p for d in deltas for p in d["delta"].get("tool_calls") or []]
    assert [p["function"]["name"] for p in pieces if p.get("id")] == ["get_weather"]
    arguments = "".join(p["function"].get("arguments") or "" for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
