"""The rest of the OpenAI surface through real clients against one `servelm serve` process:
the openai client's parse() and LangChain's with_structured_output on pydantic models, echo
and prompt_logprobs, /tokenize and /detokenize, CORS methods and headers, and every bad input
of those getting a 4xx in OpenAI's error shape while the server keeps serving."""

from __future__ import annotations

import enum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from servelm.tokenizer import load_tokenizer
from test_server import KEY, MAX_MODEL_LEN, MODEL, Server, sse_events

AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--allowed-origins", ORIGIN, "--allowed-methods", "POST",
               "--allowed-headers", "Authorization,Content-Type,X-Trace",
               "--roofline-bandwidth", "30", "--roofline-flops", "1")
    yield s.wait_ready()
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_tokenizer(gguf_path)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


# ---- structured outputs through real clients ---------------------------------------------


class Level(str, enum.Enum):
    low = "low"
    high = "high"


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]$")  # a string pattern
    level: Level                                   # an enum


class Record(BaseModel):
    name: str = Field(max_length=8)
    inner: Code                                        # a nested object
    scores: list[int] = Field(min_length=1, max_length=2)  # a bounded array
    flag: bool | int                                   # a union


def _check(rec: Record) -> None:
    assert isinstance(rec, Record) and isinstance(rec.inner, Code)
    assert isinstance(rec.inner.level, Level) and 1 <= len(rec.scores) <= 2
    assert len(rec.inner.code) == 3 and rec.inner.code[:2].isupper() and len(rec.name) <= 8


def test_openai_parse_into_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A record, as JSON."}],
        response_format=Record, max_tokens=160, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    _check(r.choices[0].message.parsed)


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0,
                      max_tokens=160, max_retries=0, timeout=120)
    _check(chat.with_structured_output(Record).invoke("A record, as JSON."))


# ---- echo and prompt logprobs -------------------------------------------------------------


def test_echo_prepends_prompt_and_its_logprobs(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=2, echo=True, extra_body={"prompt_logprobs": 2})
    c = r.choices[0]
    assert c.text == PROMPT + plain.choices[0].text
    lp, out = c.logprobs, plain.choices[0].logprobs
    n = len(ids)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] + out.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == pytest.approx(out.token_logprobs, abs=1e-5)
    assert all(v <= 0 for v in lp.token_logprobs[1:n])
    assert lp.text_offset[n] == len(PROMPT) and lp.text_offset[0] == 0
    # The echoed logprobs are the prompt_logprobs field's (vLLM's shape: token id -> entry).
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == n and plp[0] is None
    for j in range(1, n):
        entry = plp[j][str(ids[j])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[j]) and entry["rank"] >= 1
        assert entry["decoded_token"] == lp.tokens[j]
        assert lp.tokens[j] in lp.top_logprobs[j] and 2 <= len(lp.top_logprobs[j]) <= 3


def test_echo_streamed_and_without_generation(server, client, tokenizer):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                      echo=True, n=2)
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                            "echo": True, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts[0].startswith(PROMPT)  # the first chunk carries the prompt
    assert "".join(texts) == whole.choices[0].text == whole.choices[1].text
    # max_tokens 0 with echo: the prompt scored, nothing generated (token ids decoded)
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == tokenizer.decode(ids)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(r.choices[0].logprobs.tokens) == len(ids)


def test_chat_prompt_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in plp[1:])


# ---- /tokenize and /detokenize -----------------------------------------------------------


def test_tokenize_and_detokenize(server, tokenizer):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert "".join(body["token_strs"]) == PROMPT
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    msgs = [{"role": "user", "content": "Hi"}]
    for gen in (True, False):
        r = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": gen})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
        assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    # the same ids a chat request counts as its prompt
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == post(
        server, "/tokenize", {"messages": msgs}).json()["count"]
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [1]}).status_code == 401


# ---- CORS -----------------------------------------------------------------------------------


def test_cors_allowed_methods_and_headers(server):
    def preflight(method: str, headers: str) -> httpx.Response:
        return httpx.options(f"{server.url}/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers})

    ok = preflight("POST", "x-trace,content-type")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-methods"] == "POST"
    assert "x-trace" in ok.headers["access-control-allow-headers"].lower()
    assert preflight("GET", "content-type").status_code == 400      # not an allowed method
    assert preflight("POST", "x-other").status_code == 400          # not an allowed header


# ---- bad input --------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
BAD_INPUTS = [
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix",
     "fill-in-the-middle"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "echo"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": -1, "echo": True}, 400,
     "max_tokens", "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": "yes"}, 400, "echo", "bool"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 21}, 400,
     "logprobs", "20"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400,
     "prompt_logprobs", "20"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "prompt_logprobs": -1}, 400,
     "prompt_logprobs", "0"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs", "stream"),
    (CHAT, {"model": MODEL, "messages": MSG, "prompt_logprobs": "2"}, 400, "prompt_logprobs",
     "integer"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "messages", "exactly one"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt",
     "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": "x", "tokens": [1]}, 400, "tokens", "unknown field"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "role"),
    ("/tokenize", {"prompt": "hello " * 300000}, 400, "prompt", "maximum context length"),
    ("/detokenize", {"tokens": [5, 49152]}, 400, "tokens", "tokens[1] = 49152"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "-1"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", "integer"),
    ("/detokenize", {}, 400, "tokens", "required"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_INPUTS,
                         ids=[f"{i}-{row[0].strip('/')}-{row[3]}" for i, row in enumerate(BAD_INPUTS)])
def test_bad_input(server, path, body, status, param, fragment):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err


def test_still_serving_after_bad_inputs(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and r.usage.completion_tokens == 2
