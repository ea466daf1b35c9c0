"""Ollama's native API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version,
/api/embed) against one real `servelm serve`, through the real `ollama` Python client.

Greedy answers are kept a few tokens long: every test's work is the engine's, on the CPU."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import pytest

import servelm
from tests.test_server import MAX_MODEL_LEN, Server

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-servelm-ollama"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# A bare JSON call naming the tool (read as a call by the Hermes parser), forced by `format`,
# so that the tiny model's answer is a tool call whatever it would have said.
CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": "get_weather"}, "arguments": {
                   "type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--kernel-tuning", "off")
    yield s.wait_ready()
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=300)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=300)


def ollama_error(r: httpx.Response, status: int) -> str:
    """Ollama's error shape: the status, and a body of one string field, 'error'."""
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]
    return body["error"]


def check_final(r, options_predict: int | None = None) -> None:
    """The counts and durations of a done answer (Ollama's fields, nanoseconds)."""
    assert r.done and r.done_reason in ("stop", "length")
    assert r.created_at.endswith("Z")
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    for d in (r.total_duration, r.load_duration, r.prompt_eval_duration, r.eval_duration):
        assert isinstance(d, int) and d >= 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0
    if options_predict is not None:
        assert r.eval_count <= options_predict
        assert (r.eval_count == options_predict) == (r.done_reason == "length")


# ---- models ---------------------------------------------------------------------------------


def test_tags_show_ps_version(server, client):
    (entry,) = client.list().models
    assert entry.model == f"{MODEL}:latest" and entry.size > 0 and len(entry.digest) == 64
    d = entry.details
    assert (d.format, d.family, d.families, d.parameter_size) == ("gguf", "llama", ["llama"],
                                                                  "135M")
    assert d.quantization_level == "F32"  # the test server runs the Q4_1 file in float32
    for name in (MODEL, f"{MODEL}:latest", MODEL.lower()):
        shown = client.show(name)
        assert shown.details == d and "<|im_start|>" in shown.template
        assert "completion" in shown.capabilities
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.block_count"] == 30
    assert info["general.parameter_count"] > 100_000_000
    assert info["tokenizer.ggml.tokens"] == []  # long arrays left out, as Ollama does
    (running,) = client.ps().models
    assert running.model == entry.model and running.context_length == MAX_MODEL_LEN
    assert running.expires_at.year == 9999  # never unloaded
    r = httpx.get(f"{server.url}/api/version", headers=AUTH)
    assert r.json() == {"version": servelm.__version__}
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and e.value.error == "model 'llama3.2' not found"


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=server.url, headers=headers).list()
        assert e.value.status_code == 401 and "API key" in e.value.error
        ollama_error(httpx.post(f"{server.url}/api/chat", headers=headers, json={
            "model": MODEL, "messages": ASK_WEATHER}), 401)


# ---- chat and generate ----------------------------------------------------------------------


def test_chat_streamed_equals_whole(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    options = {**GREEDY, "num_predict": 5}
    whole = client.chat(model=MODEL, messages=messages, options=options, stream=False)
    assert whole.model == MODEL and whole.message.role == "assistant"
    assert whole.message.content and whole.message.tool_calls is None
    check_final(whole, 5)
    parts = list(client.chat(model=MODEL, messages=messages, options=options, stream=True))
    assert len(parts) > 1 and not any(p.done for p in parts[:-1])
    assert all(p.done_reason is None and p.eval_count is None for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    check_final(last, 5)
    assert (last.done_reason, last.prompt_eval_count, last.eval_count) == (
        whole.done_reason, whole.prompt_eval_count, whole.eval_count)


def test_generate_streamed_equals_whole_with_context(client):
    options = {**GREEDY, "num_predict": 4}
    whole = client.generate(model=MODEL, prompt="Name a fruit.", system="You are terse.",
                            options=options)
    check_final(whole, 4)
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    parts = list(client.generate(model=MODEL, prompt="Name a fruit.", system="You are terse.",
                                 options=options, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].context == whole.context
    # The context continues the conversation: its tokens come before the new prompt's.
    more = client.generate(model=MODEL, prompt="Another.", context=whole.context,
                           options={**GREEDY, "num_predict": 2})
    assert more.prompt_eval_count > len(whole.context)
    assert more.context[:len(whole.context)] == whole.context


def test_generate_raw_is_the_prompt_as_is(client):
    prompt = "The capital of France is"
    raw = client.generate(model=MODEL, prompt=prompt, raw=True,
                          options={**GREEDY, "num_predict": 3})
    check_final(raw, 3)
    assert raw.context is None  # raw mode returns no context, as Ollama's
    templated = client.generate(model=MODEL, prompt=prompt, options={**GREEDY, "num_predict": 1})
    assert templated.prompt_eval_count > raw.prompt_eval_count + 5  # the template's tokens
    parts = list(client.generate(model=MODEL, prompt=prompt, raw=True, stream=True,
                                 options={**GREEDY, "num_predict": 3}))
    assert "".join(p.response for p in parts) == raw.response


def test_load_requests(client):
    r = client.chat(model=MODEL, messages=[])
    assert (r.done, r.done_reason, r.message.content) == (True, "load", "")
    r = client.generate(model=MODEL, keep_alive=0)
    assert (r.done, r.done_reason, r.response) == (True, "load", "")


# ---- options ----------------------------------------------------------------------------------


def test_options_num_predict_stop_seed_num_ctx(server, client):
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]
    long = client.chat(model=MODEL, messages=ask, options={**GREEDY, "num_predict": 8})
    short = client.chat(model=MODEL, messages=ask, options={**GREEDY, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    assert long.message.content.startswith(short.message.content)
    text = long.message.content
    stop = text[len(text) // 2:][:3]
    stopped = client.chat(model=MODEL, messages=ask, options={**GREEDY, "num_predict": 8,
                                                              "stop": [stop]})
    assert stopped.message.content == text[:text.index(stop)]
    assert stopped.done_reason == "stop"
    # sampling with a seed repeats itself
    sampled = [client.chat(model=MODEL, messages=ask,
                           options={"temperature": 1.0, "seed": 7, "top_k": 0, "top_p": 1.0,
                                    "num_predict": 4}).message.content for _ in range(2)]
    assert sampled[0] == sampled[1]
    # num_ctx: the prompt and the answer within it
    room = client.chat(model=MODEL, messages=ask, options={
        **GREEDY, "num_ctx": short.prompt_eval_count + 2})
    assert room.eval_count == 2 and room.done_reason == "length"
    error = ollama_error(post(server, "/api/chat", {
        "model": MODEL, "messages": ask, "options": {"num_ctx": MAX_MODEL_LEN + 1}}), 400)
    assert "num_ctx" in error
    # accepted without effect: load-time options and keep_alive
    same = client.chat(model=MODEL, messages=ask, keep_alive="5m", options={
        **GREEDY, "num_predict": 3, "num_thread": 2, "num_gpu": 0, "use_mmap": True})
    assert same.message.content == short.message.content


def test_format_json_and_schema(client):
    r = client.generate(model=MODEL, prompt='Reply with the JSON object {"a": 1} only.',
                        format="json", options={**GREEDY, "num_predict": 30})
    assert isinstance(json.loads(r.response), dict) and r.done_reason == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "Is the sea wet? Answer in JSON."}]
    r = client.chat(model=MODEL, messages=ask, format=schema, options={**GREEDY,
                                                                       "num_predict": 30})
    assert set(json.loads(r.message.content)) == {"ok"} and r.done_reason == "stop"
    parts = list(client.chat(model=MODEL, messages=ask, format=schema, stream=True,
                             options={**GREEDY, "num_predict": 30}))
    assert "".join(p.message.content for p in parts) == r.message.content


def test_logprobs(client):
    r = client.chat(model=MODEL, messages=ASK_WEATHER, logprobs=True, top_logprobs=2,
                    options={**GREEDY, "num_predict": 3})
    assert len(r.logprobs) == r.eval_count == 3
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert lp.token == lp.top_logprobs[0].token  # greedy: the likeliest


# ---- tools ------------------------------------------------------------------------------------


def test_tools_give_tool_calls_streamed_and_not(client):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], format=CALL_SCHEMA,
              options={**GREEDY, "num_predict": 40})
    with ThreadPoolExecutor(1) as pool:  # both at once: one batch, not two answers in turn
        streamed = pool.submit(lambda: list(client.chat(stream=True, **kw)))
        r = client.chat(**kw)
        parts = streamed.result()
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(call.function.arguments) == {"city"} and r.message.content == ""
    assert r.done_reason == "stop"
    assert "".join(p.message.content for p in parts) == ""
    assert parts[-1].message.tool_calls == r.message.tool_calls
    assert all(p.message.tool_calls is None for p in parts[:-1])

    # The call and its result go back as history (Ollama's: no ids, the tool named).
    history = [*ASK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 25 C"}]
    after = client.chat(model=MODEL, messages=history, tools=[WEATHER],
                        options={**GREEDY, "num_predict": 3})
    assert after.prompt_eval_count > r.prompt_eval_count + 10


# ---- embeddings -------------------------------------------------------------------------------


def test_embed(client):
    r = client.embed(model=MODEL, input=["The sea is wet.", "Fire is hot."])
    assert len(r.embeddings) == 2 and r.prompt_eval_count > 0 and r.model == MODEL
    for v in r.embeddings:
        assert math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-4)  # Ollama's norm
    (one,) = client.embed(model=MODEL, input="The sea is wet.").embeddings
    assert max(abs(a - b) for a, b in zip(one, r.embeddings[0])) < 1e-4
    assert client.embed(model=MODEL, input=[]).embeddings == []


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,status,words", [
    ("/api/chat", {"model": "llama3.2", "messages": ASK_WEATHER}, 404, "model 'llama3.2'"),
    ("/api/generate", {"model": "nope", "prompt": "hi"}, 404, "not found"),
    ("/api/embed", {"model": "nope", "input": "hi"}, 404, "not found"),
    ("/api/chat", {"model": MODEL, "messages": [
        {"role": "user", "content": "What is this?", "images": ["aGVsbG8="]}]}, 400,
     "messages[0].images"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "images": ["aGVsbG8="]}, 400, "images"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "options": {"temperature": 5}},
     400, "options.temperature"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "options": {"mirostat": 2}},
     400, "mirostat"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "options": {"num_predict": 0}},
     400, "num_predict"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "options": {"no_such": 1}},
     400, "options.no_such"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "think": True}, 400,
     "does not support thinking"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "format": {"type": "nonsense"}},
     400, "format"),
    ("/api/chat", {"model": MODEL, "messages": ASK_WEATHER, "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}, 400,
     "template"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": True, "system": "x"}, 400,
     "raw mode"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "context": [10 ** 9]}, 400, "context"),
    ("/api/show", {}, 400, "model is required"),
])
def test_bad_input_gets_ollama_errors(server, path, body, status, words):
    assert words in ollama_error(post(server, path, body), status)


def test_malformed_and_still_serving(server, client):
    r = httpx.post(f"{server.url}/api/chat", content=b"{not json", headers={
        **AUTH, "Content-Type": "application/json"})
    assert "JSON" in ollama_error(r, 400)
    r = httpx.post(f"{server.url}/api/generate", content=b"", headers={
        **AUTH, "Content-Type": "application/json"})
    assert ollama_error(r, 400) == "missing request body"
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model=MODEL, messages=[{"role": "user", "content": "x",
                                                 "images": [b"\x89PNG"]}], stream=True))
    assert e.value.status_code == 400
    ok = client.chat(model=MODEL, messages=ASK_WEATHER, options={**GREEDY, "num_predict": 1})
    assert ok.done and ok.eval_count == 1
