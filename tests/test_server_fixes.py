"""What probing a running server found, each fixed and held here: a request that can never
fit the queue is a 400 (not a 503 inviting retries); running out of file descriptors logs a
line a second (not a traceback per failed accept) and serving goes on once some close;
/openapi.json lists each route's errors and /metrics as text; with a key, /metrics and the
docs are behind it unless flags open them; structured outputs end (pydantic shapes through
the openai client's parse(), fp32 and bf16)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from servelm.engine.async_engine import EngineSnapshot
from servelm.server.api import build_app
from servelm.server.options import ServerOptions
from test_server import KEY, MODEL, ROOT, Server
from test_server_api import Code, Level, Record

AUTH = {"Authorization": f"Bearer {KEY}"}
SEQS, QUEUE = 4, 4  # --max-num-seqs, --max-queue: at most 8 sequences at once


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-num-seqs", str(SEQS), "--max-queue", str(QUEUE),
               "--kernel-tuning", "off", "--threads", "1", "--roofline-bandwidth", "30",
               "--roofline-flops", "1")
    try:
        yield s.wait_ready(timeout=300)
    finally:  # a server that did not start is stopped too
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


# ---- a request that can never fit the queue --------------------------------------------------


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and "retry-after" not in e.value.response.headers
    return e.value.body


def test_prompts_that_can_never_fit_are_a_400_naming_the_limits(client):
    limit = SEQS + QUEUE
    body = _refused(lambda: client.completions.create(
        model=MODEL, prompt=["Hi"] * (limit + 1), max_tokens=1))
    assert body["param"] == "prompt" and body["code"] == "invalid_value"
    assert f"{limit + 1} prompts" in body["message"]
    assert f"--max-num-seqs {SEQS}" in body["message"] and f"--max-queue {QUEUE}" in body["message"]
    # prompts x n counts, and n alone too
    body = _refused(lambda: client.completions.create(
        model=MODEL, prompt=["Hi"] * 3, n=3, max_tokens=1))
    assert "9 sequences" in body["message"]
    body = _refused(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=limit + 1, max_tokens=1))
    assert body["param"] == "n" and f"--max-queue {QUEUE}" in body["message"]
    # As many as fit at once are served.
    r = client.completions.create(model=MODEL, prompt=["Hi"] * limit, max_tokens=1)
    assert len(r.choices) == limit


# ---- out of file descriptors -------------------------------------------------------------------


def _accept_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines()
            if re.search(r"accept|Too many open files|Traceback", ln)]


def test_out_of_file_descriptors_logs_a_line_a_second_and_serving_goes_on(server):
    pid = server.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    open_now = len(os.listdir(f"/proc/{pid}/fd"))
    before = len(server.output())
    conns = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_now + 6, hard))
        # Idle connections, 10 past the limit: they wait in the backlog. Few enough that, once
        # they close, the server accepts the waiting ones in a pause (1 s) or two: each batch
        # of accepts ends at the limit, and then asyncio pauses before the next.
        for _ in range(16):
            conns.append(socket.create_connection(_addr(server.url), timeout=5))
        time.sleep(3.5)
        lines = _accept_lines(server.output()[before:])
        assert 1 <= len(lines) <= 5, lines[:20]
        assert not any("Traceback" in ln for ln in lines)
        assert "cannot accept connections: Too many open files" in lines[0]
        for c in conns:  # the descriptors free up: the waiting connections are accepted,
            c.close()   # then this request is served, under the same low limit
        conns = []
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"{server.url}/health", timeout=3).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server.output()[before:][-2000:]
            time.sleep(0.3)
    finally:
        for c in conns:
            c.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


# ---- /openapi.json, and what the key guards --------------------------------------------------


def test_docs_and_metrics_are_behind_the_key(server):
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path
    assert "servelm_engine_steps" in httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert httpx.get(f"{server.url}/health").status_code == 200  # open for load balancers
    # The console's page is open (it asks for the key); its own calls are all under /v1,
    # which it sends the key to.
    assert httpx.get(f"{server.url}/").status_code == 200
    js = open(os.path.join(ROOT, "servelm", "server", "console", "console.js")).read()
    calls = re.findall(r"\bapi\(\s*\"([^\"]+)\"", js)
    assert calls and all(c.startswith("/v1/") for c in calls), calls
    for path in set(calls) - {"/v1/chat/completions"}:
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path


def test_openapi_lists_each_routes_errors(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    assert spec["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]

    def codes(method: str, path: str) -> set[int]:
        responses = spec["paths"][path][method]["responses"]
        for code, r in responses.items():
            if code not in ("200", "499"):
                assert r["content"]["application/json"]["schema"] == error, (path, code)
        return {int(c) for c in responses}

    generate = {200, 400, 401, 403, 404, 408, 413, 415, 499, 500, 503}
    assert codes("post", "/v1/chat/completions") == generate
    assert codes("post", "/v1/completions") == generate
    assert codes("post", "/tokenize") == {200, 400, 401, 403, 404, 408, 413, 415, 500}
    assert codes("get", "/v1/models") == {200, 401, 403, 500}
    assert codes("get", "/v1/models/{name}") == {200, 401, 403, 404, 500}  # no 422
    assert codes("get", "/health") == {200, 403, 500, 503}
    assert codes("get", "/metrics") == {200, 401, 403, 500}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def _stub_app(**options):
    """The app over an engine that never runs (its routes that need no engine answer)."""
    engine = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None),
                             snapshot=EngineSnapshot(), engine=None)
    return build_app(engine, MODEL, ServerOptions(api_keys=(KEY,), **options))


async def _status(app, path: str, headers: dict | None = None) -> int:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        return (await c.get(path, headers=headers)).status_code


@pytest.mark.parametrize("flags,open_paths", [
    ({}, set()),
    ({"public_metrics": True}, {"/metrics"}),
    ({"public_docs": True}, {"/openapi.json", "/docs", "/redoc"}),
    ({"public_metrics": True, "public_docs": True},
     {"/metrics", "/openapi.json", "/docs", "/redoc"})])
def test_flags_open_metrics_and_docs(flags, open_paths):
    app = _stub_app(**flags)
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        want = 200 if path in open_paths else 401
        assert asyncio.run(_status(app, path)) == want, (flags, path)
        assert asyncio.run(_status(app, path, AUTH)) == 200, (flags, path)
    assert asyncio.run(_status(app, "/v1/models")) == 401  # the API stays behind the key
    spec_401 = "401" in app.openapi()["paths"]["/metrics"]["get"]["responses"]
    assert spec_401 == ("/metrics" not in open_paths)


def test_serve_flags_parse():
    from servelm.cli import make_parser

    args = make_parser().parse_args(["serve", "--public-metrics", "--public-docs"])
    assert args.public_metrics and args.public_docs
    args = make_parser().parse_args(["serve"])
    assert not args.public_metrics and not args.public_docs


# ---- structured outputs end ------------------------------------------------------------------


# test_server_api's Record (its five shapes together), and each shape alone.
class Pattern(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]$")


class Enum(BaseModel):
    level: Level


class Nested(BaseModel):
    inner: Code


class Bounded(BaseModel):
    scores: list[int] = Field(min_length=1, max_length=2)


class Union(BaseModel):
    flag: bool | int


SHAPES = [Pattern, Enum, Nested, Bounded, Union, Record]


def _kw(shape) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": "A record, as JSON."}],
                response_format=shape, max_tokens=160, temperature=0)


def _parse_all(client: openai.OpenAI, also=None):
    """Each shape through parse(), all at once (one batch: the test's time is one answer's),
    with `also` (a call) beside them; its result, and the shapes' choices."""
    with ThreadPoolExecutor(len(SHAPES) + 1) as pool:
        extra = pool.submit(also) if also is not None else None
        choices = [r.choices[0] for r in
                   pool.map(lambda shape: client.chat.completions.parse(**_kw(shape)), SHAPES)]
    unfinished = {s.__name__: c.message.content for s, c in zip(SHAPES, choices)
                  if c.finish_reason != "stop"}
    assert not unfinished
    for shape, c in zip(SHAPES, choices):
        assert isinstance(c.message.parsed, shape), c.message.content
        # written compactly, as json.dumps writes it
        assert json.dumps(json.loads(c.message.content)) == c.message.content
    return (extra.result() if extra is not None else None), choices


def test_structured_outputs_end_fp32(client):
    # Record streamed, beside the shapes: the same text as its whole answer among them.
    def streamed():
        with client.chat.completions.stream(**_kw(Record)) as stream:
            return stream.get_final_completion().choices[0]

    final, choices = _parse_all(client, streamed)
    whole = choices[SHAPES.index(Record)].message
    assert final.finish_reason == "stop"
    assert final.message.content == whole.content and final.message.parsed == whole.parsed


def test_structured_outputs_end_bf16():
    s = Server("--api-key", KEY, "--dtype", "bfloat16", "--kernel-tuning", "off",
               "--roofline-bandwidth", "30", "--roofline-flops", "1")
    try:
        s.wait_ready(timeout=300)
        _parse_all(openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0,
                                 timeout=120))
    finally:
        s.stop()
