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
    assert set(req) == {"running", "waiting", "preemptions", "aborted"}
    hw = s["roofline"]["machine"]
    assert hw == {"bandwidth": BANDWIDTH, "flops": FLOPS, "ridge": pytest.approx(4.0),
                  "source": "given"}
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
    while any(t.is_alive() for t in threads):
        running.add(page.get_by_test_id("metric-running").text_content())
        kv.add(page.get_by_test_id("metric-kv-usage").text_content())
        if not shot.exists() and len(kv) >= 3 and page.locator(
                '[data-testid="roofline-chart"] .pt.decode:not(.stale)').count():
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(shot))
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
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(shot))
    print(f"console screenshot under load: {shot}")
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
