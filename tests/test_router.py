"""The router without a model: block digests (stable across processes, salted), the prefix
cache's event log, the routing policy, and the Router against fake backends in this process
(ASGI apps behind an httpx transport): events applied in order, a snapshot on reset, a
backend without cache events load-balanced, retries, 503s and bad configurations."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from servelm.engine.block_manager import BlockManager, CacheEventLog, block_digest, prompt_digests
from servelm.router.app import Router, RouterConfig, merge_metrics
from servelm.router.policy import CACHE_HIT, LOAD, ROUND_ROBIN, BackendView, Policy
from servelm.router.prompts import Prompt, cache_salt, key_salt

BS = 16
TOKENS = list(range(100, 100 + 4 * BS + 5))  # four full blocks and a partial one


# ---- digests ------------------------------------------------------------------------------


def test_digests_are_the_same_in_another_process_and_differ_by_salt():
    here = {salt: prompt_digests(TOKENS, BS, salt) for salt in (None, "", "a/b", "\x00lora:x:1")}
    # The module alone (it imports nothing of servelm's), so the process starts fast.
    path = sys.modules[BlockManager.__module__].__file__
    code = ("import importlib.util as u, json; "
            f"s=u.spec_from_file_location('bm', {path!r}); m=u.module_from_spec(s); "
            "s.loader.exec_module(m); p=m.prompt_digests; "
            f"t=list(range(100, {100 + 4 * BS + 5})); "
            f"print(json.dumps({{str(s): p(t, {BS}, s) for s in (None, '', 'a/b', "
            f"'\\x00lora:x:1')}}))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, check=True).stdout)
    assert {str(k): v for k, v in here.items()} == there
    assert len(here[None]) == 4 and len(set(here[None])) == 4
    # Every salt its own namespace, block by block (a LoRA adapter's never matches the base).
    for a in here:
        for b in here:
            if a != b:
                assert not set(here[a]) & set(here[b])
    # A digest names the whole prefix: the same block after another one differs.
    assert prompt_digests(TOKENS[BS:], BS)[0] != here[None][1]
    assert block_digest(0, None, TOKENS[:BS]) == here[None][0]


def test_block_manager_publishes_the_digests_the_router_computes():
    bm = BlockManager(8, BS, enable_caching=True, event_capacity=64)
    bm.allocate("a", len(TOKENS))
    bm.cache_full_blocks("a", TOKENS, len(TOKENS), salt="s1")
    seq, events, _ = bm.events.since(0)
    assert seq == 4 and [k for k, _ in events] == ["stored"] * 4
    assert [d for _, d in events] == prompt_digests(TOKENS, BS, "s1")
    # A second request sharing the prefix stores nothing new.
    cached = bm.find_cached_prefix(TOKENS, "s1")
    bm.allocate("b", len(TOKENS), cached)
    bm.cache_full_blocks("b", TOKENS, len(TOKENS), salt="s1")
    assert bm.events.seq == 4
    bm.free("a")
    bm.free("b")
    # Another prompt takes the pool: the evicted blocks are "removed", in eviction order.
    other = [7] * (8 * BS)
    bm.allocate("c", len(other))
    _, events, _ = bm.events.since(4)
    assert sorted(d for k, d in events if k == "removed") == sorted(prompt_digests(TOKENS, BS, "s1"))
    assert bm.events.since(None)[2] == []  # the snapshot: nothing cached any more
    assert BlockManager(8, BS).events is None  # no prefix cache, no log


def test_event_log_snapshot_when_a_reader_falls_behind():
    log = CacheEventLog(capacity=4)
    for d in range(1, 4):
        log.stored(d)
    log.removed(2)
    assert log.since(2) == (4, [("stored", 3), ("removed", 2)], None)
    assert log.since(4) == (4, [], None)
    log.stored(9)  # event 5: event 1 drops out of the log
    assert log.since(1)[1] == [("stored", 2), ("stored", 3), ("removed", 2), ("stored", 9)]
    seq, events, blocks = log.since(0)  # too far behind: the snapshot
    assert (seq, events, sorted(blocks)) == (5, None, [1, 3, 9])
    assert log.since(99)[1] is None  # a number from another log


def test_cache_salt_rule_matches_the_server():
    from servelm.server.api import _cache_salt
    from servelm.server.options import ServerOptions

    key = ServerOptions(api_keys=("sk-x",)).key_salt("sk-x")
    assert key_salt("sk-x") == key
    for ks in (None, key):
        for rs in (None, "conv-1"):
            assert cache_salt(ks, rs) == _cache_salt(ks, rs)
    assert cache_salt(key, "c", cache_prompt=False) is None


# ---- the policy ----------------------------------------------------------------------------


def _views(n=3):
    return [BackendView(f"http://b{i}", servelm=True, block_size=BS) for i in range(n)]


def test_longest_cached_prefix_wins_then_load_bound_overrides_it():
    digests = prompt_digests(TOKENS, BS)
    a, b, c = _views()
    a.cached = set(digests[:1])
    b.cached = set(digests[:3])
    c.cached = {digests[1], digests[2], digests[3]}  # not a prefix: counts nothing
    policy = Policy("cache_aware", load_bound=1000)
    choice = policy.choose([a, b, c], lambda bs, keyed: digests)
    assert (choice.backend, choice.reason, choice.cached_blocks) == (b, CACHE_HIT, 3)
    b.load_tokens = 1000  # at the bound: still the cache
    assert policy.choose([a, b, c], lambda bs, keyed: digests).backend is b
    b.load_tokens = 1001  # past it: the least loaded
    choice = policy.choose([a, b, c], lambda bs, keyed: digests)
    assert choice.reason == LOAD and choice.backend in (a, c)
    b.load_tokens, b.up = 0, False  # down: out of the rotation
    assert policy.choose([a, b, c], lambda bs, keyed: digests).backend is a


def test_ties_round_robin_and_least_loaded():
    views = _views()
    policy = Policy("cache_aware")
    picks = [policy.choose(views, lambda *k: []) for _ in range(4)]
    assert [p.backend.url for p in picks] == ["http://b0", "http://b1", "http://b2", "http://b0"]
    assert {p.reason for p in picks} == {ROUND_ROBIN}
    views[0].load_tokens = views[1].load_tokens = 50
    assert policy.choose(views, lambda *k: []).backend is views[2]
    assert policy.choose(views, lambda *k: []).reason == LOAD
    rr = Policy("round_robin")
    assert [rr.choose(views).backend.url for _ in range(3)] == ["http://b0", "http://b1",
                                                                  "http://b2"]
    assert Policy("least_loaded").choose(views, exclude=[views[2]]).backend is views[0]
    assert Policy().choose([BackendView("http://x", up=False)]) is None


def test_events_applied_in_order_and_snapshot_on_reset():
    v = BackendView("http://b")
    v.apply_events({"seq": 2, "block_size": BS, "instance": "i1", "reset": True, "events": [],
                    "blocks": ["00000000000000aa", "00000000000000bb"]})
    assert v.cached == {0xAA, 0xBB} and v.seq == 2 and v.servelm
    v.apply_events({"seq": 5, "block_size": BS, "instance": "i1", "reset": False,
                    "events": [["removed", "00000000000000aa"], ["stored", "00000000000000cc"],
                               ["removed", "00000000000000cc"], ["stored", "00000000000000aa"]]})
    assert v.cached == {0xAA, 0xBB} and v.seq == 5
    v.apply_events({"seq": 1, "block_size": BS, "instance": "i2", "reset": True, "events": [],
                    "blocks": ["00000000000000dd"]})  # restarted: its snapshot replaces all
    assert v.cached == {0xDD} and v.instance == "i2"


def test_policy_and_config_errors():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*cache_aware"):
        Policy("fastest")
    with pytest.raises(ValueError, match="at least one backend"):
        RouterConfig(backends=())
    with pytest.raises(ValueError, match="http\\(s\\) URL"):
        RouterConfig(backends=("localhost:8000",))
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(backends=("http://a:1",), policy="random")
    with pytest.raises(ValueError, match="named twice"):
        RouterConfig(backends=("http://a:1", "http://a:1/"))


def test_cli_bad_input():
    from servelm.cli import main

    assert main(["router"]) == 2  # no --backend: one line, no traceback
    with pytest.raises(SystemExit):
        main(["router", "--backend", "http://a:1", "--policy", "random"])
    assert main(["router", "--backend", "ftp://a:1"]) == 2  # one line, no traceback


# ---- the router against fake backends --------------------------------------------------------


def fake_backend(name: str, servelm: bool = True, log: list | None = None) -> FastAPI:
    """A backend answering with its name; with servelm, cache events from `state`."""
    app = FastAPI()
    app.state.events = {"seq": 0, "block_size": BS, "instance": "x", "reset": True,
                        "events": [], "blocks": []}
    app.state.since = []
    app.state.stats = {"requests": {"running": 1, "waiting": 2},
                       "prefix_cache": {"queried_tokens": 10, "hit_tokens": 5}}
    app.state.reply = None  # body -> a plain answer of another shape (may be awaitable)
    app.state.healthy = True

    @app.get("/health")
    async def health():
        if not app.state.healthy:
            from fastapi.responses import JSONResponse

            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "root": None}]}

    if servelm:
        @app.get("/v1/cache_events")
        async def events(since: int | None = None):
            app.state.since.append(since)
            return app.state.events

        @app.get("/v1/stats")
        async def stats():
            return app.state.stats

        @app.get("/metrics")
        async def metrics():
            from fastapi.responses import PlainTextResponse

            return PlainTextResponse("# HELP servelm_x An x.\n# TYPE servelm_x counter\n"
                                     'servelm_x 1.0\nservelm_y{kind="a"} 2\n')

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if log is not None:
            log.append((name, body, request.headers.get("authorization")))
        if app.state.reply is not None and not body.get("stream"):
            answer = app.state.reply(body)
            return await answer if asyncio.iscoroutine(answer) else answer
        if body.get("stream"):
            async def gen():
                for i in range(3):
                    yield f"data: {json.dumps({'backend': name, 'i': i})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return {"backend": name}

    return app


class Hosts(httpx.AsyncBaseTransport):
    """host -> an ASGI app; other hosts go over the network."""

    def __init__(self, apps: dict[str, FastAPI]):
        self.apps = {h: httpx.ASGITransport(a) for h, a in apps.items()}
        self.net = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request):
        t = self.apps.get(request.url.host, self.net)
        return await t.handle_async_request(request)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


async def _with_router(apps: dict[str, FastAPI], body, **config):
    urls = config.pop("backends", None) or tuple(f"http://{h}" for h in apps)
    router = Router(RouterConfig(backends=urls, poll_interval=0.01, **config),
                    tokenizer=object(), transport=Hosts(apps))
    await router.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(router.app()),
                               base_url="http://router")
    try:
        return await body(router, client)
    finally:
        await client.aclose()
        await router.stop()


async def _settle(router, cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("router state did not settle")


def test_router_routes_by_cached_prefix_and_streams():
    log: list = []
    apps = {"a": fake_backend("a", log=log), "b": fake_backend("b", log=log)}
    digests = prompt_digests(TOKENS, BS)
    apps["b"].state.events = {"seq": 3, "block_size": BS, "instance": "x", "reset": True,
                              "events": [], "blocks": [f"{d:016x}" for d in digests[:3]]}

    async def body(router, client):
        await _settle(router, lambda: len(router.backends[1].view.cached) == 3)
        r = await client.post("/v1/completions", json={"prompt": TOKENS, "max_tokens": 4})
        assert r.json() == {"backend": "b"}
        assert router.routed[CACHE_HIT] == 1
        # Later polls ask for the events after the last one applied.
        await _settle(router, lambda: 3 in apps["b"].state.since)
        # Streamed through as it comes, SSE intact.
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": TOKENS, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            text = "".join([c async for c in s.aiter_text()])
        assert text.count("data: ") == 4 and '"backend": "b"' in text and text.endswith(
            "data: [DONE]\n\n")
        # A prompt nobody holds: by load (ties in turn).
        names = [(await client.post("/v1/completions", json={"prompt": [1, 2, 3]})).json()
                 ["backend"] for _ in range(2)]
        assert sorted(names) == ["a", "b"]
        stats = (await client.get("/v1/stats")).json()
        assert stats["router"]["routed"]["cache_hit"] == 2
        assert stats["requests"]["waiting"] == 4 and stats["prefix_cache"]["hit_rate"] == 0.5
        assert [b["cached_blocks"] for b in stats["backends"]] == [0, 3]
        metrics = (await client.get("/metrics")).text
        assert 'servelm_x{backend="http://a"} 1.0' in metrics
        assert 'servelm_y{backend="http://b",kind="a"} 2' in metrics
        assert metrics.count("# TYPE servelm_x counter") == 1
        assert 'servelm_router_routed_total{reason="cache_hit"} 2' in metrics
        assert all(b["up"] for b in stats["backends"])
        # Every answer, streamed or not, gave its load back.
        assert [(b.view.inflight, b.view.load_tokens) for b in router.backends] == [(0, 0)] * 2

    asyncio.run(_with_router(apps, body))


def test_non_servelm_backends_are_load_balanced():
    apps = {"a": fake_backend("a", servelm=False), "b": fake_backend("b", servelm=False)}

    async def body(router, client):
        await _settle(router, lambda: all(b.view.servelm is False for b in router.backends))
        names = [(await client.post("/v1/completions", json={"prompt": TOKENS})).json()
                 ["backend"] for _ in range(4)]
        assert names in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
        assert router.routed[CACHE_HIT] == 0

    asyncio.run(_with_router(apps, body))


def test_unreachable_backend_is_retried_elsewhere_and_none_up_is_a_503():
    apps = {"a": fake_backend("a")}
    dead = f"http://127.0.0.1:{_closed_port()}"

    async def body(router, client):
        assert [b.view.up for b in router.backends] == [True, False]
        router.backends[1].view.up = True  # as if it died just after its last check
        router.policy._turn = 1            # its turn next
        r = await client.post("/v1/completions", json={"prompt": [1]})
        assert r.json() == {"backend": "a"} and router.retries == 1
        assert not router.backends[1].view.up  # out of the rotation
        router.backends[0].view.up = False
        r = await client.post("/v1/completions", json={"prompt": [1]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_backend_available"
        assert (await client.get("/health")).status_code == 503

    asyncio.run(_with_router(apps, body, backends=("http://a", dead), policy="round_robin"))


def test_router_api_keys_and_backend_key():
    log: list = []
    apps = {"a": fake_backend("a", log=log)}

    async def body(router, client):
        r = await client.post("/v1/completions", json={"prompt": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.post("/v1/completions", json={"prompt": [1]},
                              headers={"Authorization": "Bearer sk-client"})
        assert r.status_code == 200 and log[-1][2] == "Bearer sk-backend"

    asyncio.run(_with_router(apps, body, api_keys=("sk-client",),
                             backend_api_key="sk-backend"))


def test_prompt_digests_follow_keyed_backends():
    p = Prompt(TOKENS, request_salt="conv")
    assert p.digests(BS, None) == prompt_digests(TOKENS, BS, "/conv")
    assert p.digests(BS, "sk-x") == prompt_digests(TOKENS, BS, f"{key_salt('sk-x')}/conv")
    assert Prompt(TOKENS, cacheable=False).digests(BS, None) == []


def test_merge_metrics_groups_families():
    text = merge_metrics([("u1", "# HELP m h\n# TYPE m gauge\nm 1\n"),
                          ("u2", "# HELP m h\n# TYPE m gauge\nm{a=\"x y\"} 2\n")])
    assert text == ('# HELP m h\n# TYPE m gauge\nm{backend="u1"} 1\n'
                    'm{backend="u2",a="x y"} 2\n')


def test_replica_cores_and_arguments():
    from servelm.router.replicas import replica_argv, split_cores

    groups = [[0, 4], [1, 5], [2, 6], [3, 7], [8]]  # physical cores, siblings together
    assert split_cores(2, groups) == [[0, 1, 2, 4, 5, 6], [3, 7, 8]]
    assert split_cores(3, groups[:2]) == [[0, 4], [1, 5], [0, 4]]  # fewer cores: shared
    # Two NUMA nodes of unequal size: two replicas take one node each, four two each; three
    # (not a multiple of the nodes) split the cores in node order.
    numa = [[0], [1], [2], [3], [4], [5]]
    nodes = [0, 0, 0, 0, 1, 1]
    assert split_cores(2, numa, nodes) == [[0, 1, 2, 3], [4, 5]]
    assert split_cores(4, numa, nodes) == [[0, 1], [2, 3], [4], [5]]
    assert split_cores(3, numa, nodes) == [[0, 1], [2, 3], [4, 5]]
    assert split_cores(6, numa, nodes) == [[0], [1], [2], [3], [4], [5]]
    from servelm.router.replicas import core_groups
    assert core_groups([0, 1, 2, 3], node_of=lambda c: 1 - c // 2)[0][0] == 2  # node 0 first
    argv = ["--log-level", "INFO", "serve", "m.gguf", "--dp", "2", "--port=9000",
            "--host", "0.0.0.0", "--router-policy", "round_robin", "--api-key", "k"]
    assert replica_argv(argv) == ["--log-level", "INFO", "serve", "m.gguf", "--api-key", "k"]


def test_reported_load_counts_other_clients_requests():
    apps = {"a": fake_backend("a"), "b": fake_backend("b")}
    apps["a"].state.stats = {"requests": {"running_tokens": 3000, "waiting_tokens": 2000}}
    apps["b"].state.stats = {"requests": {"running_tokens": 100, "waiting_tokens": 0}}

    async def body(router, client):
        await _settle(router, lambda: router.backends[0].view.reported_tokens == 5000)
        names = [(await client.post("/v1/completions", json={"prompt": [1]})).json()
                 ["backend"] for _ in range(3)]
        assert names == ["b"] * 3 and router.routed[LOAD] == 3
        stats = (await client.get("/v1/stats")).json()
        assert [b["reported_tokens"] for b in stats["backends"]] == [5000, 100]

    asyncio.run(_with_router(apps, body, policy="least_loaded", health_interval=0.02))


def test_serve_data_parallel_size_must_be_positive():
    from servelm.cli import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
