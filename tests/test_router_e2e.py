"""`servelm serve --data-parallel-size 2` on the embedded model, end to end: the router in
front of two real replicas (with an API key, which the replicas share). A repeated
conversation goes to the replica that cached it; greedy tokens through the router equal one
engine's; a replica killed mid-stream fails that stream with an error event, the other keeps
serving, and the killed one is restarted and back in the rotation."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from test_server import KEY, MODEL, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = ("You are a careful assistant for a travel agency. You answer questions about "
          "European capitals, their museums, their food and their history, briefly and "
          "politely, and you never invent facts you are not sure of.")


class Front(Server):
    """The data-parallel front (or another KIND of replicas' front): its URL is the
    router's, not a replica's; replicas: each replica's URL, roles: its role ("" none)."""

    KIND = "data parallel"

    def wait_ready(self, timeout: float = 180) -> "Front":
        deadline = time.monotonic() + timeout
        while self.url is None:
            m = re.search(rf"on (http://[\d.]+:\d+) \({self.KIND}", self.output())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"front did not start:\n{self.output()}")
            else:
                time.sleep(0.1)
        found = re.findall(r"  replica \d (http://[\d.]+:\d+) \((?:(\w+), )?CPUs", self.output())
        self.replicas = [url for url, _ in found]
        self.roles = [role for _, role in found]
        assert len(self.replicas) == 2
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        return self


@pytest.fixture(scope="module")
def front():
    s = Front("--data-parallel-size", "2", "--api-key", KEY, "--kernel-tuning", "off",
              "--roofline-bandwidth", "30", "--roofline-flops", "1")
    yield s.wait_ready()
    s.stop()


def stats(front) -> dict:
    return httpx.get(f"{front.url}/v1/stats", headers=AUTH, timeout=30).json()


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def chat(url: str, messages: list[dict], max_tokens: int = 8) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def replica_pid(front, url: str) -> int:
    """The replica process listening on url's port (a child of the front)."""
    port = url.rsplit(":", 1)[1]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == front.proc.pid and b"--port" in args and port.encode() in args:
            return int(pid)
    raise AssertionError(f"no replica process on port {port}")


def test_keys_cache_affinity_and_greedy_parity(front):
    assert httpx.get(f"{front.url}/v1/models").status_code == 401  # the replica's check
    assert httpx.get(f"{front.url}/v1/stats").status_code == 401     # the front's
    assert httpx.get(f"{front.url}/", headers={"Host": "evil.example"}).status_code == 403
    assert httpx.get(f"{front.url}/").status_code == 200  # the console, as a server has it
    r = httpx.get(f"{front.replicas[0]}/v1/cache_events")  # the events are behind the key
    assert r.status_code == 401
    events = httpx.get(f"{front.replicas[0]}/v1/cache_events", headers=AUTH).json()
    assert events["keyed"] and events["block_size"] > 0 and events["reset"]

    convo = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "What is the capital of France?"}]
    first = chat(front.url, convo)
    before = stats(front)
    holder = wait_for(lambda: next((b["url"] for b in stats(front)["backends"]
                                    if b["cached_blocks"] > 0), None), 10, "cache events")
    convo += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
              {"role": "user", "content": "And which museum should I visit there?"}]
    chat(front.url, convo)
    after = stats(front)
    routed = {b["url"]: b["routed"] for b in after["backends"]}
    assert after["router"]["routed"]["cache_hit"] == before["router"]["routed"]["cache_hit"] + 1
    assert routed[holder] == {b["url"]: b["routed"] for b in before["backends"]}[holder] + 1
    assert after["prefix_cache"]["hit_tokens"] > 0

    # Greedy tokens through the router equal one engine's (each replica asked directly).
    prompt = {"model": MODEL, "prompt": "The three largest cities of Italy are",
              "max_tokens": 12, "temperature": 0}
    texts = [httpx.post(f"{u}/v1/completions", headers=AUTH, json=prompt, timeout=120)
             .json()["choices"][0]["text"] for u in (front.url, *front.replicas)]
    assert texts[0] and texts[0] == texts[1] == texts[2]


def test_client_leaving_a_stream_aborts_it_on_the_replica(front):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
            "ignore_eos": True, "stream": True}  # outlasts the wait unless aborted
    with httpx.stream("POST", f"{front.url}/v1/completions", headers=AUTH, json=body,
                      timeout=60) as s:
        assert next(line for line in s.iter_lines() if line.startswith("data: "))
    wait_for(lambda: stats(front)["requests"]["running"] == 0, 10, "the abort")
    assert all(b["inflight_requests"] == 0 and b["load_tokens"] == 0
               for b in stats(front)["backends"])


def test_killed_replica_fails_its_stream_and_is_restarted(front):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", headers=AUTH, json=body,
                      timeout=120) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        busy = next(b["url"] for b in stats(front)["backends"] if b["inflight_requests"])
        pid = replica_pid(front, busy)
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "backend_failed" and busy in error["message"]

    # The other replica keeps serving at once (the dead one is out of the rotation).
    for _ in range(2):
        r = httpx.post(f"{front.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    down = next(b for b in stats(front)["backends"] if b["url"] == busy)
    assert not down["up"] and down["last_error"]

    # Restarted (a new process on the same port) and back in the rotation.
    wait_for(lambda: all(b["up"] for b in stats(front)["backends"]), 120, "the restart")
    assert replica_pid(front, busy) != pid
    assert "replica" in front.output() and "restarting it" in front.output()


def test_cache_events_route(front):
    url = f"{front.replicas[1]}/v1/cache_events"
    snap = httpx.get(url, headers=AUTH).json()
    assert snap["reset"] and snap["enabled"] and isinstance(snap["blocks"], list)
    later = httpx.get(url, headers=AUTH, params={"since": snap["seq"],
                                                 "instance": snap["instance"]}).json()
    assert not later["reset"] and later["seq"] >= snap["seq"]
    other = httpx.get(url, headers=AUTH, params={"since": snap["seq"], "instance": "x"}).json()
    assert other["reset"]  # another instance's numbers: a snapshot
    r = httpx.get(url, headers=AUTH, params={"since": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
