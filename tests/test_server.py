"""The OpenAI-compatible server as a real uvicorn process, driven by the openai client and httpx.

Two processes are shared by the whole module: `server` (the main one, with an API key) and
`small_server` (--max-num-seqs 1 --max-queue 1, for admission control and SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from servelm import SamplingParams
from servelm.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-servelm-test"
MAX_MODEL_LEN = 1024
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    """A `servelm serve --port 0` subprocess; its URL is read from its start-up line."""

    def __init__(self, *extra: str):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="servelm-serve-", suffix=".log")
        cmd = [sys.executable, "-m", "servelm.cli", "serve", "--port", "0", "--dtype", "float32",
               "--kv-cache-memory", "256MiB", "--num-threads", "2",
               "--max-model-len", str(MAX_MODEL_LEN), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
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
                time.sleep(0.2)
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.2)
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
def processes():
    # Both start at once, so their model loads overlap.
    servers = {"main": Server("--api-key", KEY),
               "small": Server("--max-num-seqs", "1", "--max-queue", "1",
                               "--roofline-bandwidth", "30", "--roofline-flops", "2.3")}
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
    text = httpx.get(f"{url}/metrics").text
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


# ---- errors ---------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (path, body, status, param, fragment of the message)
    (CHAT, b'{"model": "x", "messages": [', 400, None, "malformed JSON"),
    (CHAT, b'[1, 2]', 400, None, "JSON object"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools",
     "tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_object"}}, 400,
     "response_format", "response_format"),
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
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", "role"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", "messages"),
    (CHAT, {"messages": MSG}, 400, "model", "model"),
    (CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model", "gpt-4o"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400, "prompt",
     f"maximum context length is {MAX_MODEL_LEN}"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens", "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": [999999]}, 400, "prompt", "999999"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "echo"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias",
     "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs", "20"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop", "string"),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_INPUTS,
                         ids=[f"{i}-{row[3] or row[4]}" for i, row in enumerate(BAD_INPUTS)])
def test_bad_input(server, path, body, status, param, fragment):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, **kwargs)
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
    err = next(r for r in responses if r.status_code == 503).json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "server_error" and err["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 12
               for r in responses if r.status_code == 200)
    r = httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


def test_sigterm_finishes_in_flight_then_exits_0(processes, small_server):
    proc = processes["small"].proc
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        events = sse_events([first, *lines])
    assert sum(1 for e in events for c in e["choices"] if c["text"] is not None) == 12
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=10) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{small_server.url}/health")
