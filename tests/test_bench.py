"""servelm bench against a fake OpenAI-compatible streaming server with known timings."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.bench import datasets, report
from servelm.bench.client import CLOSING, TOKEN, RequestRecord, TokenTimer, classify_chunk
from servelm.bench.runner import poisson_arrivals, run_requests
from servelm.cli import main, make_parser

TTFT = 0.05  # fake server: delay before the first token
ITL = 0.01  # fake server: delay between tokens
MODEL = "fake-model"
# 1 GB of weights per step at 100 GB/s: a decode step takes >= 10 ms whatever the batch.
ROOFLINE_METRICS = {
    "servelm_roofline_weight_bytes_per_step": 1e9,
    "servelm_roofline_kv_bytes_per_token": 1e5,
    "servelm_roofline_flops_per_token": 2e9,
    "servelm_roofline_attention_flops_per_token_context": 1e5,
    "servelm_roofline_bandwidth_bytes_per_second": 100e9,
    "servelm_roofline_flops_per_second": 1e13,
}


class FakeState:
    """What the fake server does and what it saw; reset before each test."""

    def __init__(self):
        self.tokens_per_chunk = 1
        self.continuous_usage = False
        self.fail_every = 0  # every k-th request (1-based) gets HTTP 500
        self.lock = threading.Lock()
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []


STATE = FakeState()


def _fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        st = STATE
        with st.lock:
            st.count += 1
            n = st.count
            st.bodies.append(body)
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}},
                                status_code=404)
        if st.fail_every and n % st.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if chat:
            prompt_tokens = len(body["messages"][0]["content"].split())
        else:
            p = body["prompt"]
            prompt_tokens = len(p) if isinstance(p, list) else len(p.split())
        total = body["max_tokens"]
        if not body.get("stream"):  # the whole answer at once, after the whole generation
            await asyncio.sleep(TTFT + ITL * (total - 1))
            text = "".join(f" t{j}" for j in range(total))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text})
            return JSONResponse({"choices": [choice], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": total}})

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def gen():
            with st.lock:
                st.in_flight += 1
                st.max_in_flight = max(st.max_in_flight, st.in_flight)
            done = False
            try:
                if chat:  # real servers open with a role-only delta: not a token
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                  "content": ""}}]})
                await asyncio.sleep(TTFT)
                sent = 0
                while sent < total:
                    if sent:
                        await asyncio.sleep(ITL * st.tokens_per_chunk)
                    k = min(st.tokens_per_chunk, total - sent)
                    sent += k
                    text = "".join(f" t{sent - k + j}" for j in range(k))
                    choice = ({"index": 0, "delta": {"content": text}} if chat
                              else {"index": 0, "text": text})
                    chunk = {"choices": [choice]}
                    if st.continuous_usage:
                        chunk["usage"] = {"prompt_tokens": prompt_tokens,
                                          "completion_tokens": sent}
                    yield sse(chunk)
                yield sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                    "completion_tokens": total}})
                # Leave before the client can see the end, so its next request never
                # overlaps this one in the count.
                with st.lock:
                    st.in_flight -= 1
                done = True
                yield "data: [DONE]\n\n"
            finally:
                if not done:
                    with st.lock:
                        st.in_flight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        # A servelm-like server: the roofline gauges the sweep's ideal curve is drawn from.
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse("".join(f"{k} {v}\n" for k, v in ROOFLINE_METRICS.items()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server_url):
    global STATE
    STATE = FakeState()
    return server_url


def bench(url: str, *extra: str) -> int:
    return main(["bench", "--base-url", url, "--no-progress", *extra])


def load(path) -> dict:
    return json.loads(path.read_text())


# --- end to end against the fake server ---------------------------------------------------

def test_concurrency_timings_and_json(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench(fake, "--concurrency", "4", "--num-prompts", "8", "--input-len", "16",
               "--output-len", "10", "--json", str(out), "--slo", "ttft=1,tpot=0.1")
    assert rc == 0
    table = capsys.readouterr().out
    for label in ("Successful requests", "Output token throughput", "TTFT", "TPOT", "ITL",
                  "E2E", "Goodput"):
        assert label in table

    assert STATE.max_in_flight == 4
    assert STATE.count == 9  # 8 + warm-up
    body = STATE.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["max_tokens"] == 10
    assert len(body["prompt"]) == 16 and all(1000 <= t < 20000 for t in body["prompt"])

    doc = load(out)
    assert set(doc) == {"config", "summary", "requests"}
    s = doc["summary"]
    for key in ("duration_s", "completed", "failed", "request_throughput", "output_throughput",
                "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput",
                "good_requests", "errors", "peak_concurrency"):
        assert key in s
    assert doc["config"]["concurrency"] == 4 and doc["config"]["model"] == MODEL
    assert s["completed"] == 8 and s["failed"] == 0 and s["good_requests"] == 8
    assert s["total_output_tokens"] == 80 and s["total_input_tokens"] == 128
    assert s["peak_concurrency"] <= 4
    assert all(r["output_tokens"] == 10 and r["prompt_tokens"] == 16 for r in doc["requests"])
    assert all(len(r["itl_s"]) == 9 for r in doc["requests"])
    # Loose bounds: a 2-core box runs the client and server in one process, and a noisy VM
    # stalls one request now and then, which moves the mean: the median is bounded.
    assert TTFT * 1000 <= s["ttft_ms"]["mean"]
    assert TTFT * 1000 <= s["ttft_ms"]["p50"] < TTFT * 1000 + 60
    assert ITL * 1000 * 0.8 <= s["tpot_ms"]["mean"] < ITL * 1000 * 2
    assert ITL * 1000 * 0.5 <= s["itl_ms"]["p50"] < ITL * 1000 * 2
    e2e = (TTFT + 9 * ITL) * 1000
    assert e2e <= s["e2e_ms"]["p50"] < e2e * 2
    # 8 requests in two waves of 4
    assert 2 * e2e / 1000 <= s["duration_s"] < 2 * e2e / 1000 * 2


def test_sweep_concurrency_plot_and_json(fake, tmp_path, capsys):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = bench(fake, "--sweep-concurrency", "4,1,2,6", "--num-prompts", "4", "--input-len", "8",
               "--output-len", "5", "--json", str(out), "--plot", str(png))
    assert rc == 0
    # Warm-up, then every level sends max(--num-prompts, concurrency) prompts.
    assert STATE.count == 1 + 4 + 4 + 4 + 6
    doc = load(out)
    levels = doc["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4, 6]  # sorted, deduplicated
    assert doc["config"]["sweep_concurrency"] == [1, 2, 4, 6]
    for lv in levels:
        n = max(4, lv["concurrency"])
        assert lv["summary"]["completed"] == n and len(lv["requests"]) == n
        assert lv["summary"]["peak_concurrency"] <= lv["concurrency"]
        assert lv["roofline"]["tpot_s"] == pytest.approx(0.01, rel=0.01)  # 1 GB / 100 GB/s
    # More streams in flight: more tokens per second from the fake server's fixed pace.
    tput = [lv["summary"]["output_throughput"] for lv in levels]
    assert tput[0] < tput[1] < tput[2] < tput[3]
    assert levels[3]["summary"]["peak_concurrency"] == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "ideal tok/s" in text


def test_roofline_prediction_textbook_case():
    from servelm.bench.sweep import RooflineModel

    # 7B parameters at 16 bits on 2 TB/s: 14 GB per decode step, 7 ms, ~143 tok/s alone.
    m = RooflineModel(weight_bytes=14e9, kv_bytes_per_token=0.0, flops_per_token=14e9,
                      attn_flops_per_context=0.0, bandwidth=2e12, peak_flops=1e15)
    assert m.decode_step_seconds(1, 100) == pytest.approx(7e-3)
    # Batch 256 is compute-bound: 256 * 14 GFLOP / 1 PFLOP/s = 3.6 ms < 7 ms, so still 7 ms;
    # batch 1024: 14.3 ms.
    assert m.decode_step_seconds(1024, 100) == pytest.approx(1024 * 14e9 / 1e15)
    # A 1000-token prompt is compute-bound: 14 TFLOP at 1 PFLOP/s.
    assert m.prefill_seconds(1000) == pytest.approx(14e-3)
    p = m.predict(concurrency=8, input_len=1000, output_len=100)
    # 8 prefills of 14 ms plus 100 steps of 7 ms for 800 tokens.
    assert p["output_throughput"] == pytest.approx(800 / (8 * 14e-3 + 100 * 7e-3))
    assert RooflineModel.from_metrics({"servelm_roofline_weight_bytes_per_step": 1}) is None
    # With the sampled rows' share given (1 of the 14 GFLOP), a prompt pays it once.
    h = RooflineModel(weight_bytes=14e9, kv_bytes_per_token=0.0, flops_per_token=14e9,
                      attn_flops_per_context=0.0, bandwidth=2e12, peak_flops=1e15,
                      sampled_row_flops=1e9)
    assert h.prefill_seconds(1000) == pytest.approx((1000 * 13e9 + 1e9) / 1e15)
    assert h.decode_step_seconds(1024, 100) == m.decode_step_seconds(1024, 100)
    scraped = {**ROOFLINE_METRICS, "servelm_roofline_lm_head_flops_per_token": 5e8}
    assert RooflineModel.from_metrics(scraped).sampled_row_flops == 5e8  # LM head only
    scraped["servelm_roofline_sampled_row_flops_per_token"] = 7e8
    assert RooflineModel.from_metrics(scraped).sampled_row_flops == 7e8
    assert RooflineModel.from_metrics(ROOFLINE_METRICS).sampled_row_flops == 0.0  # older servers


def test_poisson_sends_all_requests(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake, "--request-rate", "100", "--num-prompts", "12", "--input-len", "4",
                 "--output-len", "3", "--seed", "3", "--json", str(out)) == 0
    assert STATE.count == 13
    doc = load(out)
    assert doc["summary"]["completed"] == 12 and len(doc["requests"]) == 12
    assert doc["config"]["request_rate"] == 100
    starts = [r["start_s"] for r in doc["requests"]]
    want = poisson_arrivals(12, 100, seed=3)
    assert all(abs(a - b) < 0.03 for a, b in zip(starts, want))


def test_request_rate_inf_all_at_once(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake, "--request-rate", "inf", "--num-prompts", "6", "--input-len", "4",
                 "--output-len", "5", "--json", str(out), "--no-warmup") == 0
    assert STATE.max_in_flight == 6
    assert load(out)["config"]["request_rate"] == "inf"


def test_failures_counted(fake, tmp_path, capsys):
    STATE.fail_every = 3
    out = tmp_path / "r.json"
    assert bench(fake, "--concurrency", "1", "--num-prompts", "6", "--input-len", "4",
                 "--output-len", "3", "--no-warmup", "--json", str(out)) == 0
    s = load(out)["summary"]
    assert s["completed"] == 4 and s["failed"] == 2
    assert s["errors"] == [{"message": "HTTP 500: boom", "count": 2}]
    assert "2 x HTTP 500: boom" in capsys.readouterr().out
    assert [r["success"] for r in load(out)["requests"]] == [True, True, False] * 2


def test_no_stream_times_whole_answers(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake, "--concurrency", "2", "--num-prompts", "4", "--input-len", "4",
                 "--output-len", "5", "--no-stream", "--json", str(out)) == 0
    assert all(b["stream"] is False and "stream_options" not in b for b in STATE.bodies)
    data = load(out)
    assert data["config"]["stream"] is False
    for r in data["requests"]:
        assert r["success"] and r["output_tokens"] == 5
        # one chunk: the first token arrives with the last
        assert r["ttft_s"] == pytest.approx(r["e2e_s"], abs=0.01)
        assert r["ttft_s"] >= TTFT + 4 * ITL


def test_chat_endpoint_uses_reported_prompt_tokens(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake, "--endpoint", "/v1/chat/completions", "--concurrency", "2",
                 "--num-prompts", "2", "--input-len", "7", "--output-len", "4",
                 "--json", str(out)) == 0
    assert STATE.bodies[-1]["messages"][0]["role"] == "user"
    reqs = load(out)["requests"]
    # the role-only opening chunk is not a token
    assert all(r["prompt_tokens"] == 7 and r["output_tokens"] == 4 and len(r["itl_s"]) == 3
               for r in reqs)


def test_multi_token_chunks_split_by_usage(fake, tmp_path):
    STATE.tokens_per_chunk = 3
    STATE.continuous_usage = True
    out = tmp_path / "r.json"
    assert bench(fake, "--concurrency", "1", "--num-prompts", "1", "--input-len", "4",
                 "--output-len", "7", "--no-warmup", "--json", str(out)) == 0
    r = load(out)["requests"][0]
    # chunks of 3, 3, 1 tokens: the gaps before the 2nd and 3rd chunks give 3 + 1 entries
    assert r["output_tokens"] == 7 and len(r["itl_s"]) == 4
    assert r["itl_s"][0] == pytest.approx(r["itl_s"][2], rel=1e-9)


def test_dataset_prompts(fake, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hello there world", "output_len": 2}\n\n'
                    '{"prompt": [5000, 5001]}\n')
    out = tmp_path / "r.json"
    assert bench(fake, "--dataset", str(data), "--output-len", "5", "--concurrency", "2",
                 "--num-prompts", "3", "--json", str(out)) == 0
    reqs = load(out)["requests"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in reqs] == [(3, 2), (2, 5), (3, 2)]


def test_wrong_model_fails_at_warmup(fake, capsys):
    rc = bench(fake, "--model", "nope", "--concurrency", "1", "--num-prompts", "1",
               "--input-len", "4", "--output-len", "2")
    err = capsys.readouterr().err
    assert rc == 2 and "warm-up request" in err and "HTTP 404" in err and "not found" in err
    assert STATE.count == 1


def test_unreachable_url_fails_fast(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    t = time.monotonic()
    rc = bench(f"http://127.0.0.1:{port}", "--concurrency", "4", "--num-prompts", "100",
               "--input-len", "4", "--output-len", "2")
    assert rc == 2 and time.monotonic() - t < 5
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot connect" in err


# --- flag validation ----------------------------------------------------------------------

BASE = ["bench", "--base-url", "http://localhost:1"]


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "2", "--request-rate", "3"], "not allowed with"),
    (["--sweep-concurrency", "1,x"], "expected a positive integer"),
    (["--sweep-concurrency", "2", "--concurrency", "2"], "not allowed with"),
    (["--concurrency", "0"], "expected a positive integer"),
    (["--request-rate", "-1"], "expected a positive number"),
    (["--request-rate", "x"], "expected a positive number"),
    (["--concurrency", "1", "--num-prompts", "-5"], "expected a positive integer"),
    (["--concurrency", "1", "--slo", "ttft=fast"], "not a number"),
    (["--concurrency", "1", "--slo", "speed=1"], "bad SLO"),
])
def test_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args(BASE + flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "2", "--input-len", "2", "--output-len", "2", "--endpoint", "/v1/x"],
     "endpoint must end in"),
    (["--dataset", "/nonexistent.jsonl"], "cannot read dataset"),
])
def test_bad_combinations(flags, message, capsys):
    assert main(BASE + ["--concurrency", "1"] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_defaults_for_a_bare_bench(capsys):
    from servelm.bench.cli import apply_defaults

    args = make_parser().parse_args(["bench"])
    assert args.base_url == "http://127.0.0.1:8000"  # `servelm serve`'s default address
    apply_defaults(args)
    assert (args.concurrency, args.request_rate, args.sweep_concurrency) == (8, None, None)
    assert (args.num_prompts, args.input_len, args.output_len) == (32, 256, 128)
    # Another mode, or given values, are kept; a dataset keeps its own count and lengths.
    args = make_parser().parse_args(["bench", "--request-rate", "2", "--input-len", "7"])
    apply_defaults(args)
    assert (args.concurrency, args.request_rate, args.input_len) == (None, 2.0, 7)
    args = make_parser().parse_args(["bench", "--dataset", "d.jsonl"])
    apply_defaults(args)
    assert (args.num_prompts, args.input_len, args.output_len) == (None, None, None)
    with pytest.raises(SystemExit):
        make_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    for shown in ("(default: http://127.0.0.1:8000", "(default: 256)",
                  "(default for random prompts: 128)", "(default: 32;", "--sweep-concurrency is "
                  "given: 8)", "(default: /v1/completions)"):
        assert shown in text


def test_defaults_reach_the_server(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake, "--num-prompts", "3", "--output-len", "2", "--json", str(out)) == 0
    assert STATE.count == 4 and STATE.max_in_flight == 3  # all 3 at once: concurrency 8
    assert all(len(b["prompt"]) == 256 for b in STATE.bodies[1:])
    doc = load(out)
    assert doc["config"]["concurrency"] == 8 and doc["config"]["input_len"] == 256
    assert doc["summary"]["total_input_tokens"] == 3 * 256


def test_single_run_plot(fake, tmp_path, capsys, monkeypatch):
    import matplotlib.image

    from servelm.bench import plot

    drawn = []
    real_plot_run = plot.plot_run

    def spy(series, path, title):
        drawn.append((series, title))
        real_plot_run(series, path, title)

    monkeypatch.setattr(plot, "plot_run", spy)
    out, png = tmp_path / "r.json", tmp_path / "run.png"
    rc = bench(fake, "--concurrency", "2", "--num-prompts", "6", "--input-len", "8",
               "--output-len", "5", "--json", str(out), "--plot", str(png))
    assert rc == 0 and f"wrote {png}" in capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert matplotlib.image.imread(png).shape[:2] == (495, 1650)  # 15 x 4.5 in at 110 dpi

    [(series, title)] = drawn
    assert "8 in / 5 out" in title and "concurrency 2" in title
    doc = load(out)
    s, reqs = doc["summary"], doc["requests"]
    assert sum(series.bucket_tokens) == s["total_output_tokens"] == 30
    assert sum(r * series.bucket_s for r in series.bucket_rates) == pytest.approx(30)
    assert series.duration_s == s["duration_s"]
    # Each token lands in the bucket of its arrival: start + TTFT + the gaps before it.
    w = series.bucket_s
    assert len(series.bucket_tokens) == math.ceil(s["duration_s"] / w) >= plot.MIN_BUCKETS
    expected = [0] * len(series.bucket_tokens)
    for r in reqs:
        t = r["start_s"] + r["ttft_s"]
        for gap in [0.0] + r["itl_s"]:
            t += gap
            expected[min(int(t / w), len(expected) - 1)] += 1
    assert series.bucket_tokens == expected
    assert series.ttft_ms == pytest.approx([1000 * r["ttft_s"] for r in reqs])
    assert series.tpot_ms == pytest.approx([1000 * r["tpot_s"] for r in reqs])
    assert series.itl_ms == pytest.approx([1000 * x for r in reqs for x in r["itl_s"]])
    assert len(series.itl_ms) == 6 * 4


def test_token_times_and_buckets():
    from servelm.bench import plot

    t0 = 100.0
    streamed = rec(0, 0.2, 1.2, 3, itl=[0.5, 0.5], start=t0 + 0.5)   # tokens at 0.7, 1.2, 1.7
    whole = rec(1, 0.4, 0.4, 5, start=t0 + 1.0)                        # 5 tokens at once: 1.4
    failed = rec(2, None, 0.01, 4, ok=False, error="boom", start=t0)
    assert plot.token_times(streamed, t0) == pytest.approx([0.7, 1.2, 1.7])
    assert plot.token_times(whole, t0) == pytest.approx([1.4] * 5)
    assert plot.token_times(failed, t0) == []
    records = [streamed, whole, failed]
    assert plot.throughput_buckets(records, t0, 2.0, 1.0) == [1, 7]
    assert plot.throughput_buckets(records, t0, 2.0, 0.5) == [0, 1, 6, 1]
    # A run shorter than its last tokens' clock readings: they count in the last bucket.
    assert plot.throughput_buckets(records, t0, 1.0, 1.0) == [8]
    assert [plot.bucket_width(d) for d in (60.0, 10.0, 9.0, 0.3, 0.01)] == [
        1.0, 1.0, 0.5, 0.025, 0.01]
    series = plot.run_series(records, t0, 2.0)
    assert series.bucket_s == 0.1 and sum(series.bucket_tokens) == 8
    assert series.ttft_ms == pytest.approx([200, 400]) and series.tpot_ms == pytest.approx([500, 0])


def test_bad_url_scheme(capsys):
    assert main(["bench", "--base-url", "localhost:8000", "--concurrency", "1",
                 "--num-prompts", "1", "--input-len", "1", "--output-len", "1"]) == 2
    assert "http://" in capsys.readouterr().err


# --- report math on hand-made records -----------------------------------------------------

def rec(i, ttft, e2e, out, ok=True, itl=(), start=0.0, error=None):
    return RequestRecord(index=i, output_len=out, success=ok, error=error, prompt_tokens=10,
                         output_tokens=out if ok else 0, start=start, ttft=ttft, e2e=e2e,
                         itl=list(itl))


def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert report.percentile(xs, 0) == 1 and report.percentile(xs, 100) == 5
    assert report.percentile(xs, 50) == 3
    assert report.percentile(xs, 90) == pytest.approx(4.6)
    assert report.percentile(xs, 99) == pytest.approx(4.96)
    assert report.percentile([1.0, 2.0], 50) == 1.5
    assert report.percentile([7.0], 99) == 7
    stats = report.latency_stats([0.001, 0.002, 0.003, 0.004])
    assert stats == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert report.latency_stats([]) is None


def test_summary_throughput_tpot_and_goodput():
    records = [
        rec(0, 0.1, 1.0, 10, itl=[0.1] * 9),  # tpot 0.1
        rec(1, 0.2, 0.65, 10, itl=[0.05] * 9, start=0.5),  # tpot 0.05
        rec(2, 0.9, 1.35, 10, itl=[0.05] * 9, start=1.0),  # tpot 0.05, ttft too slow
        rec(3, 0.3, 0.3, 1, start=1.0),  # one token: no tpot, cannot miss a tpot SLO
        rec(4, None, 0.01, 5, ok=False, error="HTTP 500: boom", start=1.5),
    ]
    s = report.summarize(records, duration=2.0, slo={"ttft": 0.5, "tpot": 0.06})
    assert s["completed"] == 4 and s["failed"] == 1
    assert s["total_output_tokens"] == 31 and s["total_input_tokens"] == 40
    assert s["request_throughput"] == 2.0
    assert s["output_throughput"] == 15.5 and s["total_token_throughput"] == 35.5
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 50 + 50) / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx(50)
    assert s["ttft_ms"]["p50"] == pytest.approx(250)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * (0.9 + 0.45 + 0.45) / 27)
    assert s["good_requests"] == 2 and s["goodput"] == 1.0  # requests 1 and 3
    assert s["errors"] == [{"message": "HTTP 500: boom", "count": 1}]
    assert s["peak_concurrency"] == 3  # 1, 2 and 3 overlap; 0 ends as 2 and 3 start
    table = report.format_table(s)
    widths = {len(line) for line in table.splitlines()[1:11]}
    assert widths == {50}


def test_parse_slo_units():
    assert report.parse_slo("ttft=0.5, tpot=50ms,e2e=2s") == pytest.approx(
        {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0})
    for bad in ("ttft", "ttft=-1", "", "itl=1", "ttft=inf"):
        with pytest.raises(ValueError):
            report.parse_slo(bad)


def test_timer_ignores_final_usage_total():
    r = RequestRecord(index=0, output_len=5, start=0.0)
    t = TokenTimer(r)
    t.content(0.1, None)
    t.content(0.2, None)
    t.content(0.3, {"completion_tokens": 5})  # a total riding on the last chunk, not 3 tokens
    assert r.ttft == pytest.approx(0.1) and r.itl == pytest.approx([0.1, 0.1])


def test_classify_chunks():
    def comp(text, finish=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def chat(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    kind = classify_chunk
    assert kind(comp(" a")) == kind(comp(" a", "length")) == TOKEN
    assert kind(comp("")) == TOKEN  # a token whose text is held back
    assert kind(comp("", "length")) == kind(chat({}, "stop")) == CLOSING
    assert kind(comp(None)) is None
    assert kind({"choices": [], "usage": {"completion_tokens": 3}}) is None
    assert kind(chat({"role": "assistant", "content": ""})) is None
    assert kind(chat({"role": None, "content": ""})) == TOKEN
    assert kind(chat({"content": "hi"}, "length")) == TOKEN


@pytest.mark.parametrize("usage_total, itl", [(3, [0.1, 0.1]), (4, [0.1, 0.1, 0.1]),
                                              (None, [0.1, 0.1])])
def test_closing_chunk_counts_only_when_usage_says_so(usage_total, itl):
    r = RequestRecord(index=0, output_len=4, start=0.0)
    t = TokenTimer(r)
    for now in (0.1, 0.2, 0.3):
        t.content(now, None)
    t.closing(0.4, None)
    t.finish(usage_total)
    assert r.itl == pytest.approx(itl)


# --- scheduling and prompts without a server ----------------------------------------------

def test_poisson_arrivals_seeded_and_mean_rate():
    a = poisson_arrivals(4000, 20.0, seed=1)
    assert a == poisson_arrivals(4000, 20.0, seed=1) != poisson_arrivals(4000, 20.0, seed=2)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / 3999 == pytest.approx(1 / 20, rel=0.1)
    assert poisson_arrivals(3, float("inf")) == [0.0] * 3


def test_runner_keeps_exact_concurrency():
    in_flight = peak = 0

    async def send(i, item):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.002 * (i % 3))
        in_flight -= 1
        return item * 2

    done = []
    results, duration = asyncio.run(run_requests(list(range(10)), send, concurrency=3,
                                                 on_done=done.append))
    assert results == [2 * i for i in range(10)] and sorted(done) == results
    assert peak == 3 and duration > 0


def test_random_prompts_exact_and_seeded():
    p = datasets.random_token_prompts(3, 17, 5, seed=7)
    assert p == datasets.random_token_prompts(3, 17, 5, seed=7)
    assert all(len(x.prompt) == x.input_len == 17 and x.output_len == 5 for x in p)
    assert p[0].prompt != p[1].prompt
    w = datasets.random_word_prompts(2, 9, 4, seed=1)
    assert all(len(x.prompt.split()) == 9 and x.input_len is None for x in w)


def test_load_jsonl_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    for text, message in [('{"text": "x"}', '"prompt" key'), ("nope", "not JSON"),
                          ('{"prompt": "x"}', "no \"output_len\""),
                          ('{"prompt": [1, 2], "output_len": 1}', "token-id prompts"),
                          ('{"prompt": "x", "output_len": 0}', "positive integer"),
                          ("", "no prompts")]:
        f.write_text(text)
        with pytest.raises(datasets.DatasetError, match=message):
            datasets.load_jsonl(f, None, None, allow_token_ids=False)


def test_server_utilization_over_the_run_window():
    from servelm.bench.report import server_utilization

    before = {"servelm_decode_step_seconds_total": 1.0, "servelm_decode_step_bytes_total": 10e9,
              "servelm_prefill_step_seconds_total": 2.0, "servelm_prefill_step_flops_total": 1e12}
    after = {"servelm_decode_step_seconds_total": 3.0, "servelm_decode_step_bytes_total": 50e9,
             "servelm_prefill_step_seconds_total": 2.5, "servelm_prefill_step_flops_total": 1.5e12,
             "servelm_roofline_bandwidth_bytes_per_second": 40e9,
             "servelm_roofline_flops_per_second": 2e12}
    u = server_utilization(before, after)
    assert u["decode_bandwidth_gb_s"] == pytest.approx(20.0)       # 40 GB in 2 s
    assert u["decode_bandwidth_utilization"] == pytest.approx(0.5)
    assert u["prefill_tflops"] == pytest.approx(1.0)                # 0.5 TFLOP in 0.5 s
    assert u["prefill_flops_utilization"] == pytest.approx(0.5)
    assert server_utilization(None, after) is None  # not a servelm server
