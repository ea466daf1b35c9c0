"""`servelm serve --disaggregate` on the embedded model, end to end: a prefill replica and a
decode replica (one core each) behind the router, with an API key (so the KV travels under
the key's cache salt). A long prompt runs on the prefill replica, its KV reaches the decode
replica, which answers computing only past it, with the tokens one engine gives; a short
one goes straight to the decode replica; a killed prefill replica costs only the recompute."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from conftest import TEXT_PROMPTS
from test_router_e2e import AUTH, MODEL, Front, replica_pid, stats, wait_for
from test_server import KEY

CONTEXT = ("A guide for travellers: the old town keeps its medieval walls, the river market "
           "opens at dawn, the museum of maps shows charts of the northern islands, and the "
           "bakers on the square sell rye bread until noon. ") * 2


class DisaggregatedFront(Front):
    KIND = "disaggregated"

    def wait_ready(self, timeout: float = 180) -> "DisaggregatedFront":
        super().wait_ready(timeout)
        self.prefill = self.replicas[self.roles.index("prefill")]
        self.decode = self.replicas[self.roles.index("decode")]
        # The router splits once it has the tokenizer and knows the decode replica's
        # receiver (from its stats).
        wait_for(lambda: (lambda s: s["router"]["tokenizer"] and s["router"][
            "prefill_backends_up"] == 1 and all(b["kv_receiver"] for b in s["backends"]
                                                if b["role"] == "decode"))(stats(self)),
                 60, "the router")
        return self


@pytest.fixture(scope="module")
def front():
    s = DisaggregatedFront("--disaggregate", "--api-key", KEY, "--kernel-tuning", "off",
                           "--roofline-bandwidth", "30", "--roofline-flops", "1",
                           "--kv-cache-memory", "64MiB")
    yield s.wait_ready()
    s.stop()


def complete(url: str, prompt: str, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 12,
                         "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_long_prompts_prefill_on_one_replica_and_decode_on_the_other(front):
    before = stats(front)["router"]["prefilled"]
    for i, p in enumerate(TEXT_PROMPTS[:3]):
        prompt = f"Guide {i}. {CONTEXT}{p}"  # each its own: nothing of it cached yet
        via = complete(front.url, prompt)
        # One engine alone, computing the whole prompt (nothing of it cached).
        alone = complete(front.prefill, prompt, cache_prompt=False)
        assert via["choices"][0]["text"] == alone["choices"][0]["text"]
        assert via["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = stats(front)
    assert after["router"]["prefilled"]["remote"] - before["remote"] == 3
    kv = {b["role"]: b["stats"]["kv_transfer"] for b in after["backends"]}
    assert kv["decode"]["received"]["transfers"] == kv["prefill"]["sent"]["transfers"] > 0
    assert kv["prefill"]["sent"]["failures"] == 0
    # A short prompt is the decode replica's alone, as is one it holds cached but its end.
    local = after["router"]["prefilled"]["local"]
    complete(front.url, "Hi")
    complete(front.url, f"Guide 0. {CONTEXT}And the bakers?")
    assert stats(front)["router"]["prefilled"]["local"] == local + 2


def test_a_killed_prefill_replica_costs_only_the_recompute(front):
    pid = replica_pid(front, front.prefill)
    os.kill(pid, signal.SIGKILL)
    answer = complete(front.url, f"Guide 10. {CONTEXT}Where is the museum of maps?")
    assert answer["choices"][0]["text"]
    prefilled = stats(front)["router"]["prefilled"]
    assert prefilled["failed"] + prefilled["local"] >= 1
    # (Its restart by the supervisor is test_router_e2e's.)
