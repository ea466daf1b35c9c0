"""The web console: GET / and its assets, the stats endpoint it polls (GET /v1/stats), and the
page itself in headless Chromium (Debian's package, driven by Playwright's Python API).

One `servelm serve` for the module, with an API key (the page must ask for it) and the
machine's roofline given by flags (ridge 4 FLOP/B), so which phase is memory- or
compute-bound does not depend on what a busy machine measures. One browser for every
browser test, one page that they share as a user would: it keeps its key and its chat.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server import KEY, MODEL, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
# --roofline-bandwidth 20 (GB/s), --roofline-flops 0.08 (TFLOP/s): the ridge at 4 FLOP/B, above
# fp32 decode at a batch of 4 (~2 FLOP/B) and below any prefill of 11 or more tokens.
BANDWIDTH, FLOPS = 20e9, 80e9
ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--roofline-bandwidth", "20", "--roofline-flops", "0.08")
    try:
        yield s.wait_ready(timeout=300)  # a busy 2-core machine can take minutes
    finally:
        s.stop()


def stats(url: str) -> dict:
    r = httpx.get(f"{url}/v1/stats", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def chat_body(i: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream,
            "messages": [{"role": "user", "content": f"Request {i}: tell me about the sea."}]}


def concurrent_chats(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    """n chats sent at once from threads (started; join them)."""
    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(i, max_tokens),
                       headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def decode_totals(s: dict) -> tuple[float, float]:
    """(bytes, FLOPs) of every decode step since start, from the since-start point."""
    p = s["roofline"]["decode"]["total"]
    return (0.0, 0.0) if p is None else (p["bandwidth"] * p["seconds"], p["flops"] * p["seconds"])


# ---- the stats report, without a server -------------------------------------------------------


def test_stats_rates_span_the_last_seconds_of_reports():
    """Rates and current points are counter growth since the oldest report within the
    window (none from a report too recent); percentiles are nearest-rank."""
    from collections import deque
    from types import SimpleNamespace

    from servelm.engine.async_engine import EngineSnapshot
    from servelm.engine.engine import EngineStats
    from servelm.roofline import Hardware, ModelShape
    from servelm.server import stats as live

    now = [100.0]
    shape = ModelShape(num_params=1000, weight_bits=16)
    engine = SimpleNamespace(snapshot=EngineSnapshot(), engine=SimpleNamespace(
        hardware=Hardware(1e9, 4e9), shape=shape, max_model_len=64,
        block_manager=SimpleNamespace(num_blocks=8, block_size=16)))
    metrics = SimpleNamespace(recent_ttft=deque(float(i) for i in range(1, 101)),
                              recent_tpot=deque())
    ls = live.LiveStats(engine, metrics, "m", clock=lambda: now[0])

    def at(t: float, **counters) -> dict:
        now[0] = t
        engine.snapshot = EngineSnapshot(num_running=2, kv_cache_usage=0.25,
                                         stats=EngineStats(**counters))
        return ls.report()

    first = at(100.0)
    assert first["window_s"] is None and first["tokens"]["generated_per_s"] is None
    assert first["roofline"]["decode"] == {"current": None, "total": None}
    assert at(100.1, num_generated_tokens=5)["window_s"] is None  # too soon to tell
    r = at(102.0, num_generated_tokens=50, decode_seconds=1.0, decode_bytes=2e8,
           decode_flops=1e8)
    assert r["window_s"] == pytest.approx(2.0) and r["tokens"]["generated_per_s"] == 25
    cur = r["roofline"]["decode"]["current"]
    assert cur == {"seconds": 1.0, "bandwidth": 2e8, "flops": 1e8, "intensity": 0.5,
                   "bound": "memory", "utilization": 0.2}  # the ridge is at 4 FLOP/B
    assert r["roofline"]["decode"]["total"] == cur and r["roofline"]["prefill"]["total"] is None
    assert r["kv_cache"]["blocks_used"] == 2 and r["kv_cache"]["capacity_tokens"] == 128
    assert r["latency"]["ttft_s"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert r["latency"]["tpot_s"] is None and r["latency"]["requests"] == 100
    # Past the window the old reports are forgotten: the base is the one from t=102.
    r = at(104.5, num_generated_tokens=60, decode_seconds=1.0, decode_bytes=2e8,
           decode_flops=1e8)
    assert r["window_s"] == pytest.approx(2.5) and r["tokens"]["generated_per_s"] == 4
    assert r["roofline"]["decode"]["current"] is None  # no decode step since then
    assert r["roofline"]["decode"]["total"]["intensity"] == 0.5
    assert live.phase_point(1e9, 8e9, 1.0, Hardware(1e9, 4e9))["bound"] == "compute"


# ---- the page's files -------------------------------------------------------------------------


def test_page_and_assets_are_served_with_a_strict_csp(server):
    page = httpx.get(f"{server.url}/")  # no key: the page itself is open
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    for rule in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                 "connect-src 'self'"):
        assert rule in csp
    assert "unsafe" not in csp
    assert '<meta name="servelm-api-key" content="required">' in page.text  # it will ask
    html = page.text
    assets = re.findall(r'(?:src|href)="(/console/[^"]+)"', html)
    assert sorted(assets) == ["/console/console.css", "/console/console.js"]
    # Every script is a file (CSP forbids inline ones anyway); no inline style either.
    assert all("src=" in tag for tag in re.findall(r"<script[^>]*>", html))
    assert " style=" not in html
    weight = {"/": len(page.content)}
    for name, ctype in (("console.js", "text/javascript"), ("markdown.js", "text/javascript"),
                        ("roofline.js", "text/javascript"), ("console.css", "text/css")):
        r = httpx.get(f"{server.url}/console/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype)
        assert r.headers["x-content-type-options"] == "nosniff"
        weight[name] = len(r.content)
        # Nothing refers to another origin (the SVG namespace is a name, not a request), and
        # no script turns text into HTML.
        assert set(re.findall(r"https?://[^\s\"'`)]+", r.text)) <= {"http://www.w3.org/2000/svg"}
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in r.text, (name, sink)
    print(f"console page weight: {sum(weight.values())} bytes {weight}")
    assert sum(weight.values()) < 100_000
    assert httpx.get(f"{server.url}/console/nope.js").status_code == 404
    assert httpx.get(f"{server.url}/console/index.html").status_code == 404  # only at /


def test_stats_need_the_key_and_report_the_engine_and_the_machine(server):
    r = httpx.get(f"{server.url}/v1/stats")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    s = stats(server.url)
    assert s["object"] == "servelm.stats" and s["model"] == MODEL
    kv = s["kv_cache"]
    assert kv["capacity_tokens"] == kv["blocks_total"] * kv["block_size"] > 0
    assert kv["bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # fp32 K and V of 3 KV heads x 30 layers
    # 256 MiB of fp32 blocks of 16 tokens
    assert kv["blocks_total"] == (256 << 20) // (16 * kv["bytes_per_token"])
    assert 0 <= kv["blocks_used"] <= kv["blocks_total"] and 0 <= kv["usage"] <= 1
    assert kv["max_model_len"] == 1024
    req = s["requests"]
    assert set(req) == {"running", "waiting", "preemptions", "aborted", "running_tokens",
                        "waiting_tokens"}
    hw = s["roofline"]["machine"]
    assert hw == {"bandwidth": BANDWIDTH, "flops": FLOPS, "ridge": pytest.approx(4.0),
                  "source": "given", "int8_ops": None,
                  "q8act_ops": None, "w8a8_ops": None}  # given roofs: the int8 ones not measured
    assert 1e8 < s["roofline"]["weight_bytes_per_step"] < 6e8
    assert set(s["tokens"]) >= {"prompt", "generated", "prompt_per_s", "generated_per_s"}
    assert set(s["latency"]) == {"requests", "ttft_s", "tpot_s"}


def test_stats_follow_load_and_decode_intensity_grows_with_the_batch(server):
    """A lone chat, then four at once: the counters add up, running and KV use show the load
    while it lasts, and the decode steps' arithmetic intensity rises with the batch (the
    decode point moves toward the ridge)."""
    s0 = stats(server.url)
    b0, f0 = decode_totals(s0)
    for t in concurrent_chats(server.url, 1, 8):
        t.join()
    s1 = stats(server.url)
    b1, f1 = decode_totals(s1)
    lone = (f1 - f0) / (b1 - b0)

    threads = concurrent_chats(server.url, 4, 32)
    running, used, current = [], [], []
    while any(t.is_alive() for t in threads):
        s = stats(server.url)
        running.append(s["requests"]["running"])
        used.append(s["kv_cache"]["blocks_used"])
        if s["roofline"]["decode"]["current"]:
            current.append(s)
        time.sleep(0.05)
    for t in threads:
        t.join()
    s2 = stats(server.url)
    b2, f2 = decode_totals(s2)
    batched = (f2 - f1) / (b2 - b1)

    assert max(running) >= 2 and len(set(used)) >= 2 and max(used) > 0, (running, used)
    assert s1["tokens"]["generated"] - s0["tokens"]["generated"] == 8
    assert s2["tokens"]["generated"] - s1["tokens"]["generated"] == 4 * 32
    assert s2["tokens"]["prompt"] > s1["tokens"]["prompt"] > s0["tokens"]["prompt"]
    assert s2["requests"]["running"] == 0 and s2["kv_cache"]["blocks_used"] == 0
    # fp32: 2 FLOPs per 4-byte weight per sequence, less the KV bytes: ~0.5 FLOP/B alone.
    assert 0.3 < lone < 0.55 and 2.5 * lone < batched < 4 * lone, (lone, batched)
    assert current, "no report saw a decode step in its window"
    for s in current:
        p = s["roofline"]["decode"]["current"]
        assert p["intensity"] == pytest.approx(p["flops"] / p["bandwidth"])
        assert p["bound"] == "memory" and p["utilization"] == pytest.approx(
            p["bandwidth"] / BANDWIDTH)
        assert 0 < s["window_s"] <= 3.0
        assert s["tokens"]["generated_per_s"] > 0
    # Prefill: ~20 prompt tokens a sequence (its first block cached) or more in a step.
    pre = s2["roofline"]["prefill"]["total"]
    assert pre["intensity"] > 4 and pre["bound"] == "compute"
    assert pre["utilization"] == pytest.approx(pre["flops"] / FLOPS)
    lat = s2["latency"]
    assert lat["requests"] - s0["latency"]["requests"] == 5
    for k in ("ttft_s", "tpot_s"):
        assert 0 < lat[k]["p50"] <= lat[k]["p90"] <= lat[k]["p99"]


def test_stats_count_prefix_cache_hits(server):
    before = stats(server.url)["prefix_cache"]
    body = chat_body(0, 1)
    body["messages"][0]["content"] = "The same long question, asked twice. " * 8
    for _ in range(2):
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                          timeout=120).status_code == 200
    after = stats(server.url)["prefix_cache"]
    assert after["hit_tokens"] - before["hit_tokens"] >= 64  # the second ask's whole blocks
    assert after["hit_rate"] == pytest.approx(after["hit_tokens"] / after["queried_tokens"])


# ---- the page in a browser --------------------------------------------------------------------


class Recorder:
    """Everything the page logged as an error, and every URL it asked for."""

    def __init__(self, page):
        self.errors: list[str] = []
        self.urls: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: r.failure != "net::ERR_ABORTED"
                and self.errors.append(f"{r.url}: {r.failure}"))
        page.on("request", lambda r: self.urls.append(r.url))

    def assert_clean(self, origin: str) -> None:
        assert self.errors == []
        elsewhere = [u for u in self.urls if not u.startswith(origin + "/")
                     and not u.startswith("data:")]
        assert elsewhere == [], elsewhere


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (`make test` installs it: "
                    "apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture(scope="module")
def console(browser, server):
    """The console open in one page, its API key given as a user would: (page, recorder)."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    rec = Recorder(page)
    page.goto(f"{server.url}/")
    page.get_by_test_id("api-key-input").fill(KEY)  # the page asks before calling /v1
    page.get_by_test_id("api-key-submit").click()
    page.locator("#model option").first.wait_for(state="attached", timeout=60_000)
    yield page, rec
    page.close()


def watch_answer(page) -> None:
    """Record each distinct length the latest answer's text takes, into window.lengths."""
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const out = document.querySelector('[data-testid="chat-output"]');
            const n = out ? out.textContent.length : 0;
            if (n && window.lengths.at(-1) !== n) window.lengths.push(n);
        }).observe(document.getElementById('log'),
                   {subtree: true, childList: true, characterData: true});
    }""")


def ask(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.get_by_test_id("chat-input").fill(text)
    page.get_by_test_id("chat-send").click()


def last_answer(page):
    """The latest answer, once it has finished (the page then marks how)."""
    # A function, not an expression: the page's CSP forbids the eval() an expression needs.
    page.wait_for_function(
        "() => document.querySelector('#log article:last-of-type')?.dataset.finish",
        timeout=120_000)
    return page.locator("#log article.assistant").last


def test_console_streams_an_answer_with_its_timings(console, server):
    page, rec = console
    assert page.locator("#model").input_value() == MODEL
    watch_answer(page)
    ask(page, "Write a short story about a lighthouse keeper.", 16)
    answer = last_answer(page)
    assert answer.get_attribute("data-finish") == "length"
    lengths = page.evaluate("() => window.lengths")
    assert len(lengths) >= 4 and lengths == sorted(lengths), lengths  # grew, step by step
    meta = answer.locator(".meta").text_content()
    assert re.fullmatch(r"TTFT [\d.]+ m?s · TPOT [\d.]+ m?s · \d+ prompt (\(\d+ cached\) )?"
                        r"\+ 16 generated tokens · hit max tokens", meta), meta
    rec.assert_clean(server.url)


def test_stop_aborts_the_answer_on_the_server(console, server):
    page, rec = console
    aborted = stats(server.url)["requests"]["aborted"]
    watch_answer(page)
    ask(page, "Tell me a very long story.", 900)
    page.wait_for_function("() => window.lengths.length >= 2", timeout=120_000)
    page.get_by_test_id("chat-stop").click()
    answer = last_answer(page)
    assert answer.get_attribute("data-finish") == "stopped"
    assert "≈" in answer.locator(".meta").text_content()  # measured by the page
    deadline = time.monotonic() + 10
    while (s := stats(server.url))["requests"]["aborted"] == aborted:
        assert time.monotonic() < deadline, "the server never saw the stop"
        time.sleep(0.1)
    assert s["requests"]["running"] == 0
    rec.assert_clean(server.url)


def test_dashboard_shows_the_load(console, server):
    """Four chats at once (sent by the test): the dashboard shows them running, its KV use
    changes, and the roofline places the decode steps; a screenshot is kept."""
    page, rec = console
    threads = concurrent_chats(server.url, 4, 48)
    running, kv = set(), set()
    shot = ARTIFACTS / "console-under-load.png"
    ARTIFACTS.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)  # never pass on an earlier run's picture
    while any(t.is_alive() for t in threads):
        now = page.get_by_test_id("metric-running").text_content()
        running.add(now)
        kv.add(page.get_by_test_id("metric-kv-usage").text_content())
        if not shot.exists() and now.isdigit() and int(now) >= 2 and len(kv) >= 3 and page.locator(
                '[data-testid="roofline-chart"] .pt.decode:not(.stale)').count():
            page.screenshot(path=str(shot))  # mid-load, with the batch's decode point live
        time.sleep(0.1)
    for t in threads:
        t.join()
    busy = {int(r) for r in running if r.isdigit()} - {0}
    assert busy and max(busy) >= 2, running
    used = {int(k.split("/")[0].replace(",", "")) for k in kv if "/" in k}
    assert len(used) >= 2 and max(used) > 0, kv
    bandwidth = page.get_by_test_id("metric-decode-bandwidth").text_content()
    assert re.fullmatch(r"[\d.]+ [kMG]?B/s", bandwidth), bandwidth
    assert "memory-bound" in page.get_by_test_id("metric-decode-bound").text_content()
    chart = page.get_by_test_id("roofline-chart")
    assert chart.locator(".roof").count() == 1 and chart.locator(".pt.decode").count() == 1
    if not shot.exists():
        page.screenshot(path=str(shot))
    print(f"console screenshot under load: {shot}")
    rec.assert_clean(server.url)


def test_dashboard_shows_each_replica_behind_a_router(console, server):
    """Behind a router (data parallel, disaggregated) /v1/stats carries each backend's own
    report: the dashboard lists them, a row each, and hides the table for a lone server."""
    page, rec = console
    real = stats(server.url)
    routed = {**real, "router": {"policy": "cache_aware", "prefill_backends_up": 1,
                                 "prefilled": {"remote": 3, "local": 5, "failed": 0}},
              "backends": [
                  {"url": "http://10.0.0.1:8000", "role": "prefill", "up": True, "routed": 3,
                   "stats": {**real, "kv_transfer": {"sent": {"tokens": 4096}}}},
                  {"url": "http://10.0.0.2:8000", "role": "decode", "up": False,
                   "routed": 8, "stats": None}]}
    page.route("**/v1/stats", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps(routed)))
    try:
        rows = page.locator("#m-replicas tr")
        rows.nth(1).wait_for(timeout=10_000)
        assert page.get_by_test_id("replicas").is_visible()
        first = rows.nth(0).locator("td").all_text_contents()
        assert first[:4] == ["http://10.0.0.1:8000", "prefill", "up", "3"]
        assert first[-1] == "4,096 tokens sent"
        second = rows.nth(1).locator("td").all_text_contents()
        assert second[:4] == ["http://10.0.0.2:8000", "decode", "down", "8"]
        assert "stale" in rows.nth(1).get_attribute("class")
        assert "prefilled apart 3" in page.locator("#m-router").text_content()
    finally:
        page.unroute("**/v1/stats")
    page.wait_for_function("() => document.getElementById('replicas').hidden",
                           timeout=10_000)
    rec.assert_clean(server.url)


def test_model_output_cannot_inject_html(console, server):
    """An answer full of markup (served here by a route, as a hostile model could write it)
    is shown as text; the Markdown around it still renders."""
    page, rec = console
    hostile = ['<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>",
               "\n\n**bold** and `<b>code</b>` [a link](javascript:alert(1))\n",
               "```html\n<iframe src=\"/\"></iframe>\n```\n"]
    chunks = [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]}
              for c in hostile]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=sse))
    try:
        ask(page, "Say something dangerous.", 16)
        last_answer(page)
    finally:
        page.unroute("**/v1/chat/completions")
    out = page.get_by_test_id("chat-output")
    for tag in ("img", "script", "b", "iframe", "a"):
        assert out.locator(tag).count() == 0, tag
    assert page.evaluate("() => window.pwned") is None
    text = out.text_content()
    assert '<img src=x onerror="window.pwned=1">' in text and "<script>" in text
    assert out.locator("strong").text_content() == "bold"
    assert out.locator("p code").text_content() == "<b>code</b>"
    assert out.locator("pre code").text_content() == '<iframe src="/"></iframe>'
    assert "(javascript:alert(1))" in text  # an address is shown, never followed
    rec.assert_clean(server.url)


# ---- the layout, 360 px to 4K, and Markdown tables --------------------------------------------

LONG_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
# An answer with a table, a long unbroken word and a long code line: none may widen the page.
TABLE_ANSWER = (
    "Two models compared:\n\n"
    "| Model | Params | Notes |\n"
    "|:---|---:|:---:|\n"
    f"| `{LONG_NAME}` | 1.5 B | **fast**, splits on `a\\|b` |\n"
    "| SmolLM2 | 135 M |\n"
    "\nThen a word too long for any line: " + "w" * 150 + "\n\n"
    "```python\nprint(" + "'code', " * 40 + ")\n```\n")


def sse(text: str, pieces: int = 6) -> str:
    """`text` as a chat completion's event stream, in `pieces` chunks."""
    step = -(-len(text) // pieces)
    chunks = [{"choices": [{"index": 0, "delta": {"content": text[i:i + step]},
                            "finish_reason": None}]} for i in range(0, len(text), step)]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def wide_content(browser, server):
    """A second console page whose server lists a long model name first (served here by a
    route) and whose chat holds TABLE_ANSWER; its dashboard polls the real server, which has
    answered two chats (every figure then has a value, at its widest)."""
    for t in concurrent_chats(server.url, 2, 16):
        t.join()
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    rec = Recorder(page)
    models = {"object": "list", "data": [
        {"id": LONG_NAME, "object": "model", "owned_by": "servelm", "max_model_len": 32768},
        {"id": MODEL, "object": "model", "owned_by": "servelm", "max_model_len": 1024}]}
    page.route("**/v1/models", lambda route: route.fulfill(json=models))
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=sse(TABLE_ANSWER)))
    page.goto(f"{server.url}/")
    page.get_by_test_id("api-key-input").fill(KEY)
    page.get_by_test_id("api-key-submit").click()
    page.locator("#model option").first.wait_for(state="attached", timeout=60_000)
    ask(page, "Compare two models in a table.", 64)
    last_answer(page)
    page.wait_for_function("() => document.querySelector('#roofline .roof')", timeout=60_000)
    yield page, rec
    page.close()


# Every way the page can fail to fit, as a list of sentences (empty: it fits). A "card" is
# the header, the chat panel or a dashboard card. An element inside a card must lie within the
# card's box, unless an element between them clips it (it then scrolls there: only a code
# block or a table may scroll sideways); no two runs of text overlap (the chart's own labels
# aside); no title is cut; the model picker has room for its selected name.
LAYOUT_PROBLEMS = """() => {
    const problems = [];
    const view = document.documentElement.clientWidth;
    if (document.documentElement.scrollWidth > view) {
        problems.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} px`);
    }
    const name = (e) => `${e.tagName.toLowerCase()}${e.id ? '#' + e.id : ''}` +
        `${[...e.classList].map((c) => '.' + c).join('')} "${e.textContent.trim().slice(0, 30)}"`;
    const clips = (e) => getComputedStyle(e).overflowX !== 'visible';
    const cards = [...document.querySelectorAll('.top, .chat, .card')];
    for (const card of cards) {
        const box = card.getBoundingClientRect();
        if (box.left < -0.5 || box.right > view + 0.5) problems.push(`${name(card)} off screen`);
        for (const e of [card, ...card.querySelectorAll('*')]) {
            if (!e.getClientRects().length) continue;  // not rendered
            if (clips(e) && e.scrollWidth > e.clientWidth + 1 && !e.matches('pre, .table')) {
                problems.push(`${name(e)} scrolls sideways: ${e.scrollWidth} > ${e.clientWidth}`);
            }
            let clipped = false;
            for (let a = e.parentElement; e !== card && a !== card; a = a.parentElement) {
                clipped ||= clips(a);
            }
            const r = e.getBoundingClientRect();
            if (e === card || clipped || (!r.width && !r.height)) continue;
            if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5
                || r.bottom > box.bottom + 0.5) {
                problems.push(`${name(e)} overflows ${name(card)}`);
            }
        }
        // Runs of text, one box a line, from distinct text nodes: where they show (cut by
        // the elements that clip them), none may overlap.
        const runs = [];
        const walk = document.createTreeWalker(card, NodeFilter.SHOW_TEXT);
        for (let t; (t = walk.nextNode());) {
            if (!t.data.trim() || t.parentElement.closest('svg')) continue;
            const range = document.createRange();
            range.selectNodeContents(t);
            for (let r of range.getClientRects()) {
                r = DOMRect.fromRect(r);
                for (let a = t.parentElement; a !== card.parentElement; a = a.parentElement) {
                    if (!clips(a)) continue;
                    const c = a.getBoundingClientRect();
                    const left = Math.max(r.left, c.left), top = Math.max(r.top, c.top);
                    r = new DOMRect(left, top, Math.max(0, Math.min(r.right, c.right) - left),
                                    Math.max(0, Math.min(r.bottom, c.bottom) - top));
                }
                if (r.width && r.height) runs.push([t, r]);
            }
        }
        for (let i = 0; i < runs.length; i++) {
            for (let j = i + 1; j < runs.length; j++) {
                const [t, a] = runs[i], [u, b] = runs[j];
                const dx = Math.min(a.right, b.right) - Math.max(a.left, b.left);
                const dy = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
                if (t !== u && dx > 1 && dy > 1) {
                    problems.push(`"${t.data.trim()}" overlaps "${u.data.trim()}"`);
                }
            }
        }
    }
    for (const h of document.querySelectorAll('h1, h2')) {
        if (h.getClientRects().length && h.scrollWidth > h.clientWidth) {
            problems.push(`title ${name(h)} cut: ${h.scrollWidth} > ${h.clientWidth} px`);
        }
    }
    // The picker's room for text (its width less its padding) against the selected name's.
    const select = document.getElementById('model');
    const style = getComputedStyle(select);
    const ctx = document.createElement('canvas').getContext('2d');
    ctx.font = style.font;
    const text = select.options[select.selectedIndex].text;
    const room = select.clientWidth - parseFloat(style.paddingLeft)
        - parseFloat(style.paddingRight);
    if (ctx.measureText(text).width > room + 0.5) {
        problems.push(`the picker shows ${room} px of "${text}", ` +
                      `${ctx.measureText(text).width} px wide`);
    }
    return problems;
}"""


@pytest.mark.parametrize("width", [360, 420, 1024, 1440, 3840])
def test_console_fits_the_window(wide_content, server, width):
    """At each width the whole page fits: no card overflows or overlaps its text, no title is
    cut, the picker shows the long model name whole; a screenshot of each is kept."""
    page, rec = wide_content
    page.set_viewport_size({"width": width, "height": 900})
    for _ in range(2):  # the dashboard redrawn at this width (the chart follows its width)
        with page.expect_response("**/v1/stats"):
            pass
    assert page.locator("#model").input_value() == LONG_NAME
    problems = page.evaluate(LAYOUT_PROBLEMS)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"console-{width}px.png"
    page.screenshot(path=str(shot), full_page=True)
    assert problems == [], f"{len(problems)} problems at {width} px (see {shot}): {problems[:12]}"
    rec.assert_clean(server.url)


def test_chat_answer_renders_a_markdown_table(wide_content):
    """TABLE_ANSWER's pipe table is a <table>: its header, alignments and cells (a short row
    padded, an escaped pipe kept in its code), with the text around it as paragraphs."""
    page, _ = wide_content
    out = page.get_by_test_id("chat-output")
    table = out.locator("table")
    assert table.count() == 1
    assert table.locator("thead th").all_text_contents() == ["Model", "Params", "Notes"]
    assert [th.get_attribute("data-align") for th in table.locator("thead th").all()] == [
        "left", "right", "center"]
    rows = table.locator("tbody tr").all()
    assert [r.locator("td").all_text_contents() for r in rows] == [
        [LONG_NAME, "1.5 B", "fast, splits on a|b"], ["SmolLM2", "135 M", ""]]
    assert rows[0].locator("td").first.locator("code").text_content() == LONG_NAME
    assert rows[0].locator("td strong").text_content() == "fast"
    assert rows[0].locator("td").last.locator("code").text_content() == "a|b"
    assert out.locator("p").first.text_content() == "Two models compared:"
    assert "|" not in out.locator("p").all_text_contents()[1]


# renderMarkdown run in the page on each text: its top-level blocks, a table as its header and
# body cells ([text, alignment] each), anything else as [tag, text, tags inside it].
RENDER = """async (texts) => {
    const { renderMarkdown } = await import('/console/markdown.js');
    const cells = (row) => [...row.children].map((c) => [c.textContent, c.dataset.align || '']);
    return texts.map((text) => {
        const box = document.createElement('div');
        box.append(renderMarkdown(text));
        return [...box.children].map((b) => {
            const t = b.querySelector('table');
            if (!t) return [b.tagName.toLowerCase(), b.textContent,
                            [...b.querySelectorAll('*')].map((e) => e.tagName.toLowerCase())];
            return {head: [...t.tHead.rows].map(cells),
                    body: [...t.tBodies].flatMap((tb) => [...tb.rows].map(cells)),
                    tags: [...new Set([...t.querySelectorAll('th *, td *')]
                                      .map((e) => e.tagName.toLowerCase()))]};
        });
    });
}"""


def test_markdown_renders_pipe_tables(console):
    """GitHub's pipe tables, in the page: outer pipes optional, alignments, escaped pipes,
    rows padded or cut to the header's width, markup in a cell kept as text; a delimiter row
    of another width, or none, leaves the lines a paragraph."""
    page, _ = console
    texts = ["a | b\n--|--\n1 | 2",
             "| x |\n|---|",
             "before\n| l | c | r |\n| :-- | :-: | --: |\n"
             "| <img src=x onerror=alert(1)> | `c\\|d` | *e* |\n| 1 | 2 | 3 | 4 |\n| 5 |\n\nafter",
             "| a | b |\n|---|\n| 1 | 2 |",
             "| a | b |\n|---|---|\nplain text",
             "| a | b |\n| - | x |"]
    got = page.evaluate(RENDER, texts)
    assert got[0] == [{"head": [[["a", ""], ["b", ""]]], "body": [[["1", ""], ["2", ""]]],
                       "tags": []}]
    assert got[1] == [{"head": [[["x", ""]]], "body": [], "tags": []}]
    assert got[2] == [
        ["p", "before", []],
        {"head": [[["l", "left"], ["c", "center"], ["r", "right"]]],
         "body": [[["<img src=x onerror=alert(1)>", "left"], ["c|d", "center"], ["e", "right"]],
                  [["1", "left"], ["2", "center"], ["3", "right"]],
                  [["5", "left"], ["", "center"], ["", "right"]]],
         "tags": ["code", "em"]},
        ["p", "after", []]]
    assert got[3] == [["p", "| a | b ||---|| 1 | 2 |", ["br", "br"]]]
    assert got[4] == [{"head": [[["a", ""], ["b", ""]]], "body": [], "tags": []},
                      ["p", "plain text", []]]
    assert got[5] == [["p", "| a | b || - | x |", ["br"]]]
