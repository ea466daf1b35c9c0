"""Ollama's `think` and `thinking` against a real server whose embedded model is made to think:
a ChatML template whose generation prompt opens `<think>` (closed at once when
enable_thinking is false) and --reasoning-parser deepseek_r1, through the `ollama` client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ollama
import pytest

from test_reasoning import GREET, TEMPLATE, THOUGHT  # the model made to think
from tests.test_server import Server

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 20}


@pytest.fixture(scope="module")
def client():
    s = Server("--chat-template", TEMPLATE, "--reasoning-parser", "deepseek_r1",
               "--kernel-tuning", "off").wait_ready()
    yield ollama.Client(host=s.url, timeout=300)
    s.stop()


def joined(parts, field: str) -> str:
    return "".join(getattr(p.message, field) or "" for p in parts)


def test_thinking_apart_streamed_and_not(client):
    # The three asked at once (one batch, not three answers one after the other); think
    # unset, streamed: a thinking model thinks (Ollama's default for one).
    with ThreadPoolExecutor(3) as pool:
        streamed = pool.submit(lambda: list(client.chat(model=MODEL, messages=GREET,
                                                        options=GREEDY, stream=True)))
        whole = list(pool.map(lambda think: client.chat(model=MODEL, messages=GREET,
                                                        think=think, options=GREEDY),
                              (True, "high")))
        parts = streamed.result()
    for r in whole:
        assert (r.message.thinking, r.message.content, r.done_reason) == (THOUGHT, "Hi!", "stop")
    assert (joined(parts, "thinking"), joined(parts, "content")) == (THOUGHT, "Hi!")
    assert parts[-1].done and parts[-1].eval_count == r.eval_count


def test_think_false_is_all_answer(client):
    on = client.chat(model=MODEL, messages=GREET, options={**GREEDY, "num_predict": 3})
    off = client.chat(model=MODEL, messages=GREET, think=False,
                      options={**GREEDY, "num_predict": 3})
    assert off.message.thinking is None and off.message.content
    assert off.prompt_eval_count > on.prompt_eval_count  # the template closed the thought


def test_generate_thinking(client):
    r = client.generate(model=MODEL, prompt="Say hi", options={**GREEDY, "num_predict": 4})
    assert r.thinking and r.response == "" and r.done_reason == "length"
    parts = list(client.generate(model=MODEL, prompt="Say hi", stream=True,
                                 options={**GREEDY, "num_predict": 4}))
    assert "".join(p.thinking or "" for p in parts) == r.thinking
    assert "".join(p.response for p in parts) == ""
