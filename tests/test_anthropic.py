"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the real
`anthropic` SDK against one real `servelm serve` (the embedded SmolLM2, greedy, behind an API
key): text streamed and not (the stream's text is the greedy answer), system prompts, stop
sequences, max_tokens, a prefill, thinking blocks, forced tool calls (tool_choice any / tool,
their input streamed as input_json_delta), a tool_result conversation (prompts checked
against the chat route's rendering through /tokenize), count_tokens, the key as x-api-key or
a bearer token, and bad input answered in Anthropic's error shape while the server keeps
serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest

from test_server import KEY, MODEL, Server

GREEDY = {"temperature": 0}  # the SDK takes sampling fields through extra_body
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "description": "Get the current time in a timezone.",
        "input_schema": {"type": "object", "required": ["timezone"],
                         "properties": {"timezone": {"type": "string"}}}}


def _openai_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"],
                                             "description": tool["description"],
                                             "parameters": tool["input_schema"]}}


@pytest.fixture(scope="module")
def servers():
    """The main server, and one that reads thoughts as Qwen3's (--reasoning-parser qwen3),
    started at once so that their loads overlap."""
    started = {"main": Server("--api-key", KEY, "--kernel-tuning", "off"),
               "thinking": Server("--api-key", KEY, "--kernel-tuning", "off",
                                  "--reasoning-parser", "qwen3")}
    try:
        yield {name: s.wait_ready(timeout=300) for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _ask(client, **kw):
    return client.messages.create(model=MODEL, extra_body=GREEDY,
                                  **{"max_tokens": 32, "messages": QUESTION, **kw})


def _streamed(client, **kw):
    with client.messages.stream(model=MODEL, extra_body=GREEDY,
                                **{"max_tokens": 32, "messages": QUESTION, **kw}) as s:
        text = "".join(s.text_stream)
        return text, s.get_final_message()


def _raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, as the wire carries them."""
    with httpx.stream("POST", f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                      json={"model": MODEL, "stream": True, **GREEDY, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def _tokens(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The chat route's prompt length for `messages` (vLLM's /tokenize)."""
    r = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": messages, **({"tools": tools} if tools else {})})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


# ---- text -----------------------------------------------------------------------------------


def test_text_answer_streamed_and_not(server, client):
    msg = _ask(client)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL
    (block,) = msg.content
    assert block.type == "text" and "Paris" in block.text
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens > 0
    assert _prompt_tokens(msg.usage) == client.messages.count_tokens(
        model=MODEL, messages=QUESTION).input_tokens

    text, final = _streamed(client)
    assert text == block.text
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == block.text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(msg.usage)

    events = _raw_events(server, {"max_tokens": 32, "messages": QUESTION})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == _prompt_tokens(msg.usage)
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == block.text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == msg.usage.output_tokens


def test_system_prompt(server, client):
    system = "You are a pirate. Answer in one short sentence."
    tokens = _tokens(server, [{"role": "system", "content": system}, *QUESTION])
    as_blocks = [{"type": "text", "text": system}]
    for given in (system, as_blocks):
        assert client.messages.count_tokens(model=MODEL, system=given,
                                            messages=QUESTION).input_tokens == tokens
    # Without one, SmolLM2's template writes its own default system prompt.
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens != tokens
    # (the counts show the prompt is the chat route's; the answers, that blocks are the same)
    text = _ask(client, system=system, max_tokens=8).content[0].text
    assert text and _ask(client, system=as_blocks, max_tokens=8).content[0].text == text


def test_stop_sequences(client):
    answer = _ask(client).content[0].text  # "The capital of France is Paris."
    stop = " of"
    assert stop in answer
    msg = _ask(client, stop_sequences=["never written", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == answer[:answer.index(stop)]
    text, final = _streamed(client, stop_sequences=["never written", stop])
    assert text == msg.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_max_tokens(client):
    msg = _ask(client, max_tokens=3)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    text, final = _streamed(client, max_tokens=3)
    assert text == msg.content[0].text and final.stop_reason == "max_tokens"
    # Past the context window (1024 here) it is accepted, as Anthropic's newer models do.
    assert _ask(client, max_tokens=8192).content[0].text == _ask(client).content[0].text


def test_prefill_continues_the_final_assistant_turn(server, client):
    prefill = "The capital of France is"
    msg = _ask(client, messages=[*QUESTION, {"role": "assistant", "content": prefill}],
               max_tokens=8)
    text = msg.content[0].text
    assert not text.startswith(prefill) and "Paris" in text
    # The same continuation as a raw completion of the rendered conversation + the prefill.
    auth = {"Authorization": f"Bearer {KEY}"}
    conv = httpx.post(f"{server.url}/tokenize", headers=auth,
                      json={"messages": QUESTION}).json()["tokens"]
    more = httpx.post(f"{server.url}/tokenize", headers=auth,
                      json={"prompt": prefill, "add_special_tokens": False}).json()["tokens"]
    r = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "prompt": conv + more, "max_tokens": 8,
                         "temperature": 0})
    assert r.json()["choices"][0]["text"] == text
    assert _prompt_tokens(msg.usage) == len(conv) + len(more)


def test_thinking_blocks(servers):
    """Where the server reads thoughts as Qwen3's, a prefill opening <think> starts the
    answer inside one, which comes back as a thinking block, streamed as thinking_delta."""
    client = anthropic.Anthropic(base_url=servers["thinking"].url, api_key=KEY, max_retries=0)
    kw = dict(messages=[*QUESTION, {"role": "assistant", "content": "<think>\n"}],
              max_tokens=8)
    msg = _ask(client, **kw)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    assert "<think>" not in msg.content[0].thinking
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert deltas[0] == "thinking_delta"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


# ---- tools ----------------------------------------------------------------------------------


def _weather_question() -> list[dict]:
    return [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _check_input(block, tool: dict) -> None:
    """A tool_use block's input matches its tool's schema (required string properties)."""
    schema = tool["input_schema"]
    assert block.type == "tool_use" and block.name == tool["name"]
    assert block.id.startswith("toolu_")
    assert isinstance(block.input, dict) and set(block.input) == set(schema["required"])
    assert all(isinstance(v, str) and v for v in block.input.values())


@pytest.mark.parametrize("choice, tool", [({"type": "any"}, WEATHER),
                                          ({"type": "tool", "name": "get_time"}, TIME)])
def test_forced_tool_use(server, client, choice, tool):
    kw = dict(messages=_weather_question(), tools=[WEATHER, TIME], max_tokens=64,
              tool_choice={**choice, "disable_parallel_tool_use": True})

    # The SDK's stream helper: its events are the wire's (ping aside), its final message
    # assembled from them. Asked beside the whole answer: one batch, not two in turn.
    def stream():
        with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as s:
            return ([e for e in s if e.type in ("content_block_start", "content_block_delta",
                                                "message_delta")], s.get_final_message())

    with ThreadPoolExecutor(1) as pool:
        in_stream = pool.submit(stream)
        msg = _ask(client, **kw)
        events, final = in_stream.result()
    (block,) = msg.content
    _check_input(block, tool)
    assert msg.stop_reason == "tool_use"
    (streamed,) = final.content
    _check_input(streamed, tool)
    assert streamed.input == block.input and final.stop_reason == "tool_use"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"input_json_delta"} and len(deltas) > 1
    assert json.loads("".join(d.partial_json for d in deltas)) == block.input
    assert events[-1].delta.stop_reason == "tool_use"


def test_tool_result_conversation(server, client):
    call = _ask(client, messages=_weather_question(), tools=[WEATHER], max_tokens=64,
                tool_choice={"type": "any"})
    (use,) = call.content
    messages = [*_weather_question(),
                {"role": "assistant", "content": call.content},  # the answer, passed back
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id,
                     "content": [{"type": "text", "text": "Sunny, 24 C"}]},
                    {"type": "text", "text": "Answer in one sentence."}]}]
    # The same conversation in the chat route's terms renders to the same prompt.
    chat = [*_weather_question(),
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": use.id, "type": "function",
                             "function": {"name": use.name,
                                          "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 24 C"},
            {"role": "user", "content": "Answer in one sentence."}]
    count = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    assert count.input_tokens == _tokens(server, chat, [_openai_tool(WEATHER)])
    msg = _ask(client, messages=messages, tools=[WEATHER], max_tokens=16)
    assert msg.content and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert _prompt_tokens(msg.usage) == count.input_tokens


# ---- the key and bad input --------------------------------------------------------------------


def test_api_key(server):
    ok = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    assert ok.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    for call in (lambda: bad.messages.create(model=MODEL, max_tokens=2, messages=QUESTION),
                 lambda: bad.messages.count_tokens(model=MODEL, messages=QUESTION)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                      "messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


BAD = {
    "missing max_tokens": ({"messages": QUESTION}, "max_tokens"),
    "image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}, "'image'"),
    "image in a tool result": ({"messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": {}}]}]}]},
        "'image'"),
    "bad role": ({"messages": [{"role": "tool", "content": "hi"}]}, "role"),
    "tool_use from the user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use"),
    "unknown field": ({"messages": QUESTION, "container": "c1"}, "container"),
    "temperature": ({"messages": QUESTION, "temperature": 1.5}, "temperature"),
    "server tool": ({"messages": QUESTION, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    "tool_choice without the tool": ({"messages": QUESTION, "tools": [WEATHER],
                                      "tool_choice": {"type": "tool", "name": "nope"}},
                                     "nope"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gets_anthropics_error(server, client, case):
    body, named = BAD[case]
    body = {"model": MODEL, "max_tokens": 8, **body}
    if case == "missing max_tokens":
        del body["max_tokens"]
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content


def test_errors_through_the_sdk(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "https://example.com/a.png"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", content=b'{"model": ',
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content
