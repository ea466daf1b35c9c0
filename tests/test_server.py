"""The OpenAI-compatible server as a real uvicorn process, driven by the openai client and httpx.

Two processes are shared by the whole module: `server` (the main one, with three API keys
from the three places keys come from, an allowed host name, a 1 MiB body limit and an
8-sequence queue) and `small_server` (--max-num-seqs 1 --max-queue 1 and short timeouts, for
admission control, slow clients and SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import server_zygote
from servelm import SamplingParams
from servelm.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-servelm-test"
KEY2 = "sk-servelm-env"    # from $SERVELM_API_KEY
KEY3 = "sk-servelm-file"   # from --api-key-file
MAX_MODEL_LEN = 1024
MAX_BODY = 1 << 20
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    """A `servelm serve --port 0` subprocess; its URL is read from its start-up line."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="servelm-serve-", suffix=".log")
        args = ["serve", "--port", "0", "--dtype", "float32", "--kv-cache-memory", "256MiB",
                "--max-model-len", str(MAX_MODEL_LEN), *extra]
        # `python -m servelm.cli serve ...`, forked from a process that imported it once.
        self.proc = server_zygote.launch(args, self.log.name, ROOT, {**os.environ, **(env or {})})
        self.url = None

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 120) -> "Server":
        deadline = time.monotonic() + timeout
        while self.url is None:
            m = re.search(r"on (http://[\d.]+:\d+)", self.output())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{self.output()}")
            else:
                time.sleep(0.05)  # polled often: every module waits here for its servers
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# servelm test keys\n{KEY3}\n")
    # Both start at once, so their model loads overlap; the small one (limits and timeouts,
    # not speed) runs the untuned defaults, so only the main one measures the CPUs. Its
    # memory bandwidth is given: its short start-up probe, beside the other pytest worker,
    # can read far below the machine's, and the decode utilisation checked below then far
    # above 1.
    servers = {"main": Server("--api-key", KEY, "--api-key-file", str(key_file),
                              "--allowed-hosts", "api.example,other.example",
                              "--allowed-origins", "http://app.example",
                              "--max-request-bytes", str(MAX_BODY), "--max-queue", "8",
                              "--roofline-bandwidth", "30",
                              env={"SERVELM_API_KEY": KEY2}),
               "small": Server("--max-num-seqs", "1", "--max-queue", "1",
                               "--kernel-tuning", "off", "--roofline-bandwidth", "30", "--roofline-flops", "2.3",
                               "--header-timeout", "1", "--body-timeout", "1",
                               "--shutdown-timeout", "2")}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def server(processes) -> Server:
    return processes["main"].wait_ready()


@pytest.fixture(scope="module")
def small_server(processes) -> Server:
    return processes["small"].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_tokenizer(gguf_path)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text  # behind the key, as the API
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def sse_events(lines) -> list:
    """The JSON payloads of an SSE body, checking it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- basics ---------------------------------------------------------------------------------


def test_health_models_and_auth(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert (card.id, card.family, card.architecture) == (MODEL, "llama", "LlamaForCausalLM")
    assert card.max_model_len > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) \
            .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_chat_greedy_equals_llm(client, llm, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=12)
    choice = r.choices[0]
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert choice.index == 0 and r.object == "chat.completion" and r.model == MODEL
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == len(prompt) + len(ref.outputs[0].token_ids)
    timings = r.model_extra["metrics"]
    assert 0 < timings["ttft_s"] <= timings["e2e_s"] and timings["queue_time_s"] >= 0


def test_completion_streamed_and_not_equal_llm(server, client, llm, tokenizer):
    prompt = "The capital of France is"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    args = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=10,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 10

    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json={
            **{k: v for k, v in args.items() if k != "extra_body"}, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        events = sse_events(resp.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref.text
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert last["metrics"]["ttft_s"] > 0
    assert all("usage" not in e for e in events[:-1])


def test_chat_stream(client):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=12)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].model_extra["metrics"]["e2e_s"] > 0
    assert len({c.id for c in chunks}) == 1


def test_n2_seeds_and_stop(client, tokenizer):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2,
                seed=1234, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))

    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                       temperature=0).choices[0].text
    assert len(greedy) > 9
    stop = greedy[6:9]  # a piece from the middle of the greedy text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                  temperature=0, stop=[stop, "never-seen"])
    assert r.choices[0].text == greedy[:greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_multiple_prompts_and_logprobs(client, tokenizer):
    ids = tokenizer.encode("The KV cache stores")
    r = client.completions.create(model=MODEL, prompt=[[*ids], "def fibonacci(n):"],
                                  max_tokens=5, temperature=0, n=2, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    single = client.completions.create(model=MODEL, prompt="The KV cache stores", max_tokens=5,
                                       temperature=0)
    assert r.choices[0].text == single.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))
    assert r.usage.prompt_tokens == len(ids) + len(tokenizer.encode("def fibonacci(n):"))
    assert r.usage.completion_tokens == 20

    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user",
                                                                     "content": "Hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_logit_bias_steers_and_bans(client, tokenizer):
    """+100 on one token makes greedy decoding pick it; -100 on the greedy first token
    makes the model pick something else."""
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    plain = client.completions.create(**args).choices[0].text
    first = tokenizer.encode(plain)[0]
    banned = client.completions.create(**args, logit_bias={str(first): -100}).choices[0].text
    assert tokenizer.encode(banned)[0] != first
    z = tokenizer.encode(" zebra")[0]
    forced = client.completions.create(**args, logit_bias={str(z): 100})
    assert forced.choices[0].text == tokenizer.decode([z] * 3)


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI's legacy logprobs: up to logprobs + 1 entries, the sampled token among them."""
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                  temperature=1.5, seed=11, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                  temperature=1.5, seed=11, logprobs=2)
    lp = r.choices[0].logprobs
    assert all(tok in t and 2 <= len(t) <= 3 for t, tok in zip(lp.top_logprobs, lp.tokens))


def test_structured_outputs_over_the_api(server, client):
    """The official client's parse() with a pydantic model, vLLM's structured_outputs and
    guided_* fields, streamed and not, n > 1."""
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=12)
        legs: int = Field(ge=0, le=8)

    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet, temperature=0.8, seed=5, n=2, max_completion_tokens=60)
    assert len(r.choices) == 2
    assert all(isinstance(c.message.parsed, Pet) for c in r.choices)
    chunks = list(client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text in ("yes", "no", "maybe") and len(chunks) >= 1
    r = client.completions.create(model=MODEL, prompt="Zip code:", max_tokens=10,
                                  temperature=1.0, extra_body={"guided_regex": "[0-9]{5}"})
    assert re.fullmatch(r"[0-9]{5}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "A JSON object with one key."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _assembled(chunks) -> tuple[str, list[dict], str | None]:
    """A streamed chat answer as a client assembles it: content, tool calls, finish reason."""
    content, calls, finish = "", {}, None
    for c in chunks:
        for choice in c.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:  # the header: id, type and name come first, once
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_forced_tool_calls_match_the_tools_schemas(client):
    """tool_choice required / named: a grammar over the tools' schemas, so even the embedded
    model calls them with valid arguments; finish_reason tool_calls; streamed = whole."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice=named,
                                       temperature=0, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    content, calls, finish = _assembled(client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice=named, temperature=0,
        max_tokens=60, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]

    r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, n=2, seed=3,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0.8, max_tokens=60)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls  # one call: parallel_tool_calls is false
        args = json.loads(call.function.arguments)
        expected = {"get_weather": {"city", "unit"}, "add": {"a", "b"}}[call.function.name]
        assert set(args) == expected


def test_auto_tool_calls_are_parsed_from_the_answer(client):
    """tool_choice auto: the answer is read by the template's parser (hermes here). The
    embedded model rarely calls tools by itself, so a regex makes it write the call."""
    call = '{"name": "add", "arguments": {"a": 2, "b": 40}}'
    regex = "Adding\\.\\n<tool_call>\\n" + re.escape(call) + "\\n</tool_call>"
    ask = [{"role": "user", "content": "What is 2 + 40?"}]
    kwargs = dict(model=MODEL, messages=ask, tools=TOOLS, temperature=0, max_tokens=60,
                  extra_body={"structured_outputs": {"regex": regex}})
    # Whole, streamed and (below) without tools, asked at once: one batch, not three in turn.
    with ThreadPoolExecutor(2) as pool:
        in_stream = pool.submit(lambda: _assembled(client.chat.completions.create(**kwargs,
                                                                                 stream=True)))
        untold = pool.submit(client.chat.completions.create, **{**kwargs, "tools": None})
        r = client.chat.completions.create(**kwargs)
        (content, calls, finish), untold = in_stream.result(), untold.result()
    choice = r.choices[0]
    assert choice.message.content == "Adding."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("add", {"a": 2, "b": 40})]
    assert choice.finish_reason == "tool_calls"
    assert (content, finish) == ("Adding.", "tool_calls")
    assert calls == [{"name": "add", "arguments": choice.message.tool_calls[0].function.arguments}]
    # Without tools the same text is plain content.
    assert (untold.choices[0].message.tool_calls == []
            and "<tool_call>" in untold.choices[0].message.content)


def test_tools_reach_the_prompt_and_history_holds_calls_and_results(client):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1)
    told = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=1)
    untold = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS,
                                            tool_choice="none", max_tokens=1)
    assert told.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools described
    assert untold.usage.prompt_tokens == plain.usage.prompt_tokens
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees, snow"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > told.usage.prompt_tokens + 10


def test_langchain_binds_tools(server):
    """LangChain's bind_tools against the server: a forced call comes back as its tool_calls."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city now."""

        city: str = Field(max_length=20)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL,
                                      temperature=0, max_tokens=60, max_retries=0)
    msg = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Rome?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and set(call["args"]) == {"city", "unit"}
    assert call["args"]["unit"] in ("celsius", "fahrenheit")


# ---- load, cancellation ---------------------------------------------------------------------


def test_32_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int):
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i} says", max_tokens=8, temperature=0,
            logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        tokens, ids, finish, usage = 0, set(), [], None
        async for chunk in stream:
            ids.add(chunk.id)
            for c in chunk.choices:
                tokens += len(c.logprobs.tokens)
                if c.finish_reason:
                    finish.append(c.finish_reason)
            usage = chunk.usage or usage
        return tokens, ids, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(r[0] == 8 and r[2] == ["length"] and r[3].completion_tokens == 8 for r in results)
    ids = [next(iter(r[1])) for r in results]
    assert all(len(r[1]) == 1 for r in results) and len(set(ids)) == 32


def test_disconnect_aborts_and_frees_kv(server):
    before = scrape(server.url)["servelm_requests_aborted_total"]
    long = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900,
            "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            others = [asyncio.create_task(http.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": f"Short {i}", "max_tokens": 6})) for i in range(2)]
            async with http.stream("POST", f"{server.url}/v1/completions",
                                   json={**long, "stream": True}) as resp:
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                await http.post(f"{server.url}/v1/completions", json=long, timeout=1.5)
            return [await t for t in others]

    others = asyncio.run(main())
    assert all(r.status_code == 200 for r in others)
    deadline = time.monotonic() + 15
    while True:
        m = scrape(server.url)
        if (m["servelm_requests_aborted_total"] == before + 2
                and m["servelm_kv_cache_usage_ratio"] == 0
                and m["servelm_num_requests_running"] == 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["servelm_num_requests_waiting"] == 0
    assert m["servelm_time_to_first_token_seconds_count"] > 0
    # The client that gave up was answered nothing, and nothing failed on the server.
    assert "Traceback" not in server.output() and "InvalidStateError" not in server.output()


# ---- errors ---------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
BAD_INPUTS = [
    # (path, body, status, param, fragment of the message)
    (CHAT, b'{"model": "x", "messages": [', 400, None, "malformed JSON"),
    (CHAT, b'[1, 2]', 400, None, "JSON object"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function", "required"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": []}, 400, "tools", "at least 1"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOLS[0], TOOLS[0]]}, 400, "tools",
     "two tools are named 'get_weather'"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "bad name!"}}]}, 400,
     "tools[0].function.name", "pattern"),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required"}, 400, None,
     "requires 'tools'"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, None, "not among the tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, 400,
     "tool_choice", "auto"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "tool_choice", "combined"),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, 400,
     "tools", "bogus"),
    (CHAT, {"model": MODEL, "messages": MSG, "functions": [{"name": "f"}]}, 400, "functions",
     "use 'tools'"),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0]", "tool_call_id"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     400, "messages[0]", "tool_call_id"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": None}]},
     400, "messages[0].content", "content is required"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format.type", "json_schema"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "required"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400,
     "response_format.json_schema.schema", "bogus"),
    (CHAT, {"model": MODEL, "messages": MSG, "structured_outputs": {"regex": "[a-z"}}, 400,
     "structured_outputs.regex", "regex"),
    (CHAT, {"model": MODEL, "messages": MSG, "structured_outputs": {}}, 400,
     "structured_outputs", "exactly one"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "guided_grammar": "start: nope"}, 400,
     "guided_grammar", "nope"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "guided_choice": ["a"],
                   "guided_regex": "b"}, 400, "guided_choice", "only one"),
    (CHAT, {"model": MODEL, "messages": MSG, "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": "5"}, 400, "max_tokens", "integer"),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": 3.5}, 400, "temperature", "2"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p", "top_p"),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "n", "n"),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 100000}, 400, "n", "16"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"model": MODEL, "messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens", "min_tokens"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content",
     "text"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "role"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content",
     "required"),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": True, "stream_options": 5}, 400,
     "stream_options", "object"),
    (CHAT, {"model": MODEL, "messages": [MSG[0], 7]}, 400, "messages[1]", "object"),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 2.5}, 400, "n", "integer"),
    (CHAT, {"model": MODEL, "messages": MSG, "n": True}, 400, "n", "integer"),
    (CHAT, {"model": MODEL, "messages": MSG, "cache_salt": ""}, 400, "cache_salt", "cache_salt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300000}]}, 400,
     "messages", f"maximum context length is {MAX_MODEL_LEN}"),
    (CHAT, {"messages": MSG}, 400, "model", "model"),
    (CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model", "gpt-4o"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400, "prompt",
     f"maximum context length is {MAX_MODEL_LEN}"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens", "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": [999999]}, 400, "prompt", "999999"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"a": 10}}, 400, "logit_bias",
     "token ids"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "100"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 1}}, 400,
     "logit_bias", "49152"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs", "20"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop", "string"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop_token_ids": [2, 49152]}, 400,
     "stop_token_ids", "49152"),
    ("/v1/audio/speech", {"model": MODEL, "input": "hi"}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_INPUTS,
                         ids=[f"{i}-{row[3] or row[4]}" for i, row in enumerate(BAD_INPUTS)])
def test_bad_input(server, path, body, status, param, fragment):
    kwargs = ({"content": body, "headers": {**AUTH, "Content-Type": "application/json"}}
              if isinstance(body, bytes) else {"json": body, "headers": AUTH})
    r = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert fragment in err["message"]


def test_over_long_prompt_names_both_lengths(client, tokenizer):
    prompt = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt)
    n = len(tokenizer.encode(prompt))
    assert f"prompt is {n} tokens" in str(e.value) and str(MAX_MODEL_LEN) in str(e.value)


def test_still_serving_after_bad_inputs(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_prefix_cache_reported_in_usage_and_metrics(server, client):
    """A repeated prompt comes back with its whole blocks served from the prefix cache."""
    prompt = "Shared system prompt about the paged KV cache. " * 12  # well over one block
    before = scrape(server.url)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens == n
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text
    after = scrape(server.url)
    hits = after["servelm_prefix_cache_hits_total"] - before["servelm_prefix_cache_hits_total"]
    assert hits >= (n - 1) // 16 * 16
    assert after["servelm_engine_steps_total"] > before["servelm_engine_steps_total"]
    assert after["servelm_step_prefill_tokens_total"] > before["servelm_step_prefill_tokens_total"]


def test_metrics_report_utilisation_against_the_roofline(server, client):
    client.completions.create(model=MODEL, prompt="The roofline of decode " * 20, max_tokens=8,
                              temperature=0)
    m = scrape(server.url)
    bw = m["servelm_decode_step_bytes_total"] / m["servelm_decode_step_seconds_total"]
    assert 1e8 < bw < 1e12  # bytes/s achieved by decode steps
    assert 0 < m["servelm_decode_bandwidth_utilization"] < 5
    assert 0 < m["servelm_prefill_flops_utilization"] < 5
    assert m["servelm_prefill_step_flops_total"] > 0
    # The int8 matmul's roof (torch._int_mm, measured with the others at start-up), and
    # q8act's (int8-activation layers) where it is built.
    assert m["servelm_roofline_int8_ops_per_second"] > 1e9
    from servelm.layers import q8act, w8a8
    assert (m.get("servelm_roofline_q8act_ops_per_second", 0) > 1e9) == q8act.available()
    assert ((m.get("servelm_roofline_w8a8_ops_per_second", 0) > 1e9)
            == (w8a8.available() and w8a8.int8_dot()))
    # The model's side of the roofline (SmolLM2-135M: ~135M weights, 30 layers x 3 KV heads
    # x 64 dims x K and V), for clients that draw the prediction.
    assert 1e8 < m["servelm_roofline_weight_bytes_per_step"] < 6e8
    assert m["servelm_roofline_kv_bytes_per_token"] in (2 * 30 * 3 * 64 * 2, 2 * 30 * 3 * 64 * 4)
    assert m["servelm_roofline_flops_per_token"] == pytest.approx(2 * 134.5e6, rel=0.02)
    assert m["servelm_roofline_attention_flops_per_token_context"] == 4 * 30 * 9 * 64
    assert m["servelm_roofline_lm_head_flops_per_token"] == 2 * 49152 * 576
    assert m["servelm_roofline_sampled_row_flops_per_token"] == \
        2 * 49152 * 576 + 2 * (576 * 576 + 3 * 576 * 1536)


def test_bench_reports_the_servers_utilisation(server, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "servelm.cli", "bench", "--base-url", server.url,
                        "--api-key", KEY, "--concurrency", "2",
                        "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
                        "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Decode bandwidth utilisation" in r.stdout
    util = json.loads(out.read_text())["summary"]["server"]
    assert 0 < util["decode_bandwidth_utilization"] < 5
    assert 0 < util["prefill_flops_utilization"] < 5


# ---- hardening: connections, hosts, bodies, keys, ids, caches ------------------------------


def test_keep_alive_responses_do_not_wait_for_delayed_acks(server):
    """TCP_NODELAY: a response written in pieces on a reused connection goes out at once
    (without it each one waited ~40 ms for the client's delayed ACK)."""
    with httpx.Client(headers=AUTH) as http:
        http.get(f"{server.url}/health")
        times = []
        for _ in range(15):
            t = time.perf_counter()
            assert http.get(f"{server.url}/health").status_code == 200
            times.append(time.perf_counter() - t)
    assert sorted(times)[len(times) // 2] < 0.02, times


def test_request_ids_are_echoed_or_made(server):
    r = httpx.get(f"{server.url}/health", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    ids = {httpx.get(f"{server.url}/health").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    r = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "X-Request-Id": "x" * 200},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "e-1"}, json={})
    assert r.status_code == 401 and r.headers["x-request-id"] == "e-1"  # errors carry it too


@pytest.mark.parametrize("host,status", [
    ("evil.example", 403), ("evil.example:8000", 403), ("localhost.evil.example", 403),
    ("api.example", 200), ("OTHER.example:80", 200), ("localhost", 200), ("app.localhost", 200),
    ("127.0.0.1:1", 200), ("[::1]:8000", 200), ("10.1.2.3", 200)])
def test_host_header_must_name_this_server(server, host, status):
    r = httpx.get(f"{server.url}/health", headers={"Host": host})
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] == "host_not_allowed"
        r = httpx.post(f"{server.url}/v1/completions", headers={**AUTH, "Host": host},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 403


def test_cors_only_for_allowed_origins(server):
    """A page on --allowed-origins may call the API (preflight and answer carry the CORS
    headers); a page on another origin gets neither."""
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.url}/v1/chat/completions",
                       headers={"Origin": "http://app.example", **pre})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = httpx.options(f"{server.url}/v1/chat/completions",
                        headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_bodies_must_be_json(server, ctype):
    """A web page can post text/plain or a form without a preflight: those never run."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    headers = {**AUTH, **({"Content-Type": ctype} if ctype else {})}
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", content=body,
                    headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_bodies_over_the_limit_get_413(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}).encode()
    r = httpx.post(f"{server.url}/v1/completions", content=big,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit holds while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenising_a_big_prompt_does_not_stall_other_clients(server):
    """Long prompts (refused afterwards as too long) are tokenised off the event loop: /health
    keeps answering meanwhile. Tokenised on the loop, the six would hold it for about as long as
    the slowest of them took (a health check waits nearly that long); off it, a health check
    waits a small part of that. The bound is that ratio, so a slow or busy machine, which
    stretches both, does not fail it."""
    text = "hello world " * 13000  # under the can't-fit-whatever-it-tokenises bound
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            async def big_request():
                start = time.perf_counter()
                response = await http.post(f"{server.url}/v1/chat/completions", json=body)
                return response, time.perf_counter() - start

            big = [asyncio.create_task(big_request()) for _ in range(6)]
            worst = 0.0
            while not all(t.done() for t in big):
                t = time.perf_counter()
                assert (await http.get(f"{server.url}/health")).status_code == 200
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
            return worst, [await t for t in big]

    worst, answered = asyncio.run(main())
    assert all(r.status_code == 400 and "prompt is 2" in r.json()["error"]["message"]
               for r, _ in answered)
    slowest = max(seconds for _, seconds in answered)
    assert worst < 0.5 * slowest, (worst, slowest)


def test_each_key_and_cache_salt_has_its_own_prefix_cache(server):
    """cached_tokens must not tell a client whether another one sent a prompt."""
    prompt = "A secret shared only with the first key: 4521-7788. " * 6

    def cached(key: str, salt: str | None = None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                **({"cache_salt": salt} if salt else {})}
        r = httpx.post(f"{server.url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY) == 0
    assert cached(KEY) > 0                       # the same key: cached
    assert cached(KEY2) == 0 and cached(KEY3) == 0  # other keys (env, file): not
    assert cached(KEY2) > 0
    assert cached(KEY, "tenant-a") == 0          # a salt is a cache of its own
    assert cached(KEY, "tenant-a") > 0 and cached(KEY, "tenant-b") == 0
    assert cached(KEY2, "tenant-a") == 0         # per key, too


def test_whole_number_floats_count_as_integers(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 3.0, "n": 2.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6


def test_openapi_describes_the_request_bodies(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    schemas = spec["components"]["schemas"]
    for path, model, field in (("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/v1/completions", "CompletionRequest", "prompt")):
        post = spec["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and field in schemas[model]["properties"]
        assert "cache_salt" in schemas[model]["properties"]
        assert {"application/json", "text/event-stream"} <= set(post["responses"]["200"]["content"])
    refs = re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec))
    assert refs and all(r in schemas for r in refs)


def test_soak_of_mixed_clients_leaves_nothing_behind(server):
    """A few seconds of streams, chats, dropped streams, abandoned requests, slow readers,
    malformed and oversized bodies at once (benchmarks/soak.py runs it for minutes)."""
    from servelm.bench.soak import KINDS, rss_bytes, soak

    args = dict(model=MODEL, headers=AUTH, clients=6, max_request_bytes=MAX_BODY, max_tokens=12)
    asyncio.run(soak(server.url, 1.0, seed=1, **args))  # first-time paths, allocator pools
    rss = rss_bytes(server.proc.pid)
    rep = asyncio.run(soak(server.url, 4.0, seed=2, **args))
    growth = rss_bytes(server.proc.pid) - rss
    assert rep.problems == []
    assert all(rep.counts[k] > 0 for k in KINDS), rep.counts
    assert rep.health_checks > 30 and rep.health_max_s < 0.1, rep.to_dict()
    assert all(v == 0 for v in rep.settled.values()), rep.settled  # no KV block leaked
    assert growth < 64 * 2**20, growth


# ---- admission control, shutdown ------------------------------------------------------------


def test_queue_full_gives_503_then_recovers(small_server):
    """One running, one waiting: the rest are refused at once, and the server carries on."""
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 12, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{small_server.url}/v1/completions",
                                                    json=body) for _ in range(6)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert sorted(set(codes)) == [200, 503], codes
    refused = next(r for r in responses if r.status_code == 503)
    err = refused.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "server_error" and err["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert all(r.json()["usage"]["completion_tokens"] == 12
               for r in responses if r.status_code == 200)
    r = httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


def test_a_request_that_can_never_be_admitted_is_a_400_not_a_retry(small_server):
    r = httpx.post(f"{small_server.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_the_queue_bound_counts_only_requests_that_would_wait(server):
    """64 requests at once to an idle server with --max-queue 8: all of them fit in the
    running batch (max_num_seqs 256), so none is told to retry."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as http:
            return await asyncio.gather(*(http.post(f"{server.url}/v1/completions", json=body)
                                          for _ in range(64)))

    codes = [r.status_code for r in asyncio.run(main())]
    assert codes == [200] * 64, codes


def test_slow_headers_and_bodies_are_cut_off(small_server):
    """Slowloris: connections trickling a request head are closed after --header-timeout;
    a body slower than --body-timeout gets 408. /health answers throughout."""
    host, port = small_server.url.removeprefix("http://").split(":")
    slow = []
    for _ in range(50):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        slow.append(sock)
    body_sock = socket.create_connection((host, int(port)))
    body_sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
    start = time.monotonic()
    while time.monotonic() - start < 1.8:
        for sock in slow:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass
        t = time.perf_counter()
        assert httpx.get(f"{small_server.url}/health").status_code == 200
        assert time.perf_counter() - t < 0.5  # a blocked event loop would take seconds
        time.sleep(0.3)
    for sock in slow:
        sock.settimeout(3)
        try:
            assert sock.recv(100) == b""  # closed by the server, no response
        except ConnectionResetError:
            pass
        sock.close()
    body_sock.settimeout(3)
    head = body_sock.recv(4096)
    body_sock.close()
    assert head.startswith(b"HTTP/1.1 408"), head


def test_sigterm_drains_then_ends_late_streams_with_an_error_then_exits_0(processes,
                                                                         small_server):
    """SIGTERM: the short stream in flight finishes; the long one waiting behind it gets
    --shutdown-timeout (2 s), then an error event and [DONE]; then the process exits 0."""
    proc = processes["small"].proc
    short = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "ignore_eos": True,
             "stream": True}
    long = {**short, "max_tokens": 900}

    async def read(http, body, first=None):
        async with http.stream("POST", f"{small_server.url}/v1/completions", json=body) as resp:
            lines = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if first is not None:
                        first.set()
            return lines

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            started = asyncio.Event()
            running = asyncio.create_task(read(http, short, started))
            await started.wait()
            waiting = asyncio.create_task(read(http, long))  # queued behind it
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            at = time.monotonic()
            return await running, await waiting, time.monotonic() - at

    first, late, took = asyncio.run(main())
    done, cut = sse_events(first), sse_events(late)
    assert sum(1 for e in done for c in e["choices"] if c["text"] is not None) == 12
    assert done[-1]["choices"][0]["finish_reason"] == "length"
    assert cut[-1]["error"]["code"] == "server_shutting_down", cut[-1]
    assert sum(1 for e in cut[:-1] for c in e["choices"] if c["text"]) < 900
    assert 1.5 < took < 8, took
    assert proc.wait(timeout=10) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{small_server.url}/health")
