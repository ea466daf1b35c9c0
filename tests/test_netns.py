"""Across hosts for real (issue 56 item 4): two network namespaces on a bridge
(scripts/netns.sh), each a "host" with its own address, as a user would run servelm on two
machines. Disaggregation (a prefill server on one host sending KV over gloo to a decode
server on the other, behind `servelm router` here), data-parallel routing over both, and
tensor parallelism across them under torchrun each give one engine's greedy tokens.
Skipped where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from conftest import TEXT_PROMPTS
from helpers import network_namespaces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "scripts", "netns.sh")
A, B = "10.77.0.1", "10.77.0.2"
MODEL = "SmolLM2-135M-Instruct"
FLAGS = ["--dtype", "float32", "--kernel-tuning", "off", "--roofline-bandwidth", "30",
         "--roofline-flops", "1", "--kv-cache-memory", "64MiB", "--max-model-len", "2048",
         "--threads", "1"]
CONTEXT = ("Notes from the harbour office: ferries leave at seven and nine, the lighthouse "
           "opens on Sundays, and the fish market closes when the last boat is unloaded. ") * 2


@pytest.fixture(scope="module")
def hosts():
    why = network_namespaces()
    if why:
        pytest.skip(why)
    up = subprocess.run(["sh", NETNS, "up", "2"], capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run(["sh", NETNS, "down"], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {up.stderr.strip()[-300:]}")
    yield
    subprocess.run(["sh", NETNS, "down"], capture_output=True)


class Proc:
    """A command on host k (0: this namespace); its output in a file."""

    def __init__(self, k: int, *cmd: str, env: dict | None = None):
        self.log = open(f"/tmp/servelm-netns-{os.getpid()}-{k}-{time.monotonic_ns()}.log", "w+")
        prefix = ["sh", NETNS, "run", str(k)] if k else []
        self.proc = subprocess.Popen([*prefix, *cmd], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _serve(k: int, host: str, *extra: str) -> Proc:
    return Proc(k, sys.executable, "-m", "servelm.cli", "serve", "--host", host, "--port",
                "8000", *FLAGS, *extra)


def _wait(url: str, p: Proc, timeout: float = 180, ok=lambda r: r.status_code == 200) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        assert p.proc.poll() is None and time.monotonic() < deadline, p.output()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(hosts):
    """A prefill server on host 1 and a decode server on host 2 (gloo between them, not
    /dev/shm, which the namespaces share), and a router here over both."""
    prefill = _serve(1, A, "--role", "prefill", "--no-kv-transfer-shm")
    decode = _serve(2, B, "--role", "decode", "--kv-transfer-host", B,
                    "--kv-transfer-port", "8200")
    procs = [prefill, decode]
    try:
        for url, p in ((f"http://{A}:8000", prefill), (f"http://{B}:8000", decode)):
            _wait(f"{url}/health", p)
        router = Proc(0, sys.executable, "-m", "servelm.cli", "router", "--port", "0",
                      "--prefill", f"http://{A}:8000", "--decode", f"http://{B}:8000")
        procs.append(router)
        deadline = time.monotonic() + 60
        while not (m := re.search(r"routing on (http://\S+) ", router.output())):
            assert router.proc.poll() is None and time.monotonic() < deadline, router.output()
            time.sleep(0.1)
        url = m.group(1)
        _wait(f"{url}/v1/stats", router, ok=lambda r: (lambda s: s["router"]["tokenizer"] and all(
            b["up"] for b in s["backends"]) and s["backends"][0]["kv_receiver"])(r.json()))
        yield {"router": url, "prefill": f"http://{A}:8000", "decode": f"http://{B}:8000"}
    finally:
        for p in procs:
            p.stop()


def _complete(url: str, prompt: str, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_blocks_cross_hosts_over_gloo(servers):
    receiver = httpx.get(f"{servers['decode']}/v1/stats").json()["kv_transfer"]["receiver"]
    assert receiver == {"host": B, "port": 8200, "shm": True}
    prompt = f"Host test. {CONTEXT}When do the ferries leave?"
    sent = _complete(servers["prefill"], prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "remote_host": B, "remote_port": 8200})["kv_transfer_params"]
    assert sent["transport"] == "gloo" and sent["tokens"] == sent["cached_tokens"] > 0
    for i, p in enumerate(TEXT_PROMPTS[:2]):
        prompt = f"Day {i}. {CONTEXT}{p}"
        via = _complete(servers["router"], prompt)
        alone = _complete(servers["prefill"], prompt, cache_prompt=False)
        assert via["choices"][0]["text"] == alone["choices"][0]["text"]
        assert via["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    router = httpx.get(f"{servers['router']}/v1/stats").json()["router"]
    assert router["prefilled"]["remote"] == 2 and router["prefilled"]["failed"] == 0


def test_data_parallel_routing_across_hosts(servers):
    """Both servers answer whole requests too: a router (here, in this process) over them as
    two replicas on two hosts."""
    import asyncio

    from servelm.router.app import Router, RouterConfig

    prompt = "The three largest cities of Italy are"

    async def run() -> list[str]:
        router = Router(RouterConfig(backends=(servers["prefill"], servers["decode"]),
                                     policy="round_robin"))
        await router.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(router.app()),
                                   base_url="http://router", timeout=120)
        try:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            texts = [(await client.post("/v1/completions", json=body)).json()["choices"][0]
                     ["text"] for _ in range(2)]
            assert [b.routed for b in router.backends] == [1, 1]  # one on each host
            return texts
        finally:
            await client.aclose()
            await router.stop()

    texts = asyncio.run(run())
    assert len({*texts, _complete(servers["prefill"], prompt)["choices"][0]["text"]}) == 1


def test_tensor_parallel_across_hosts(servers):
    prompt = TEXT_PROMPTS[0]
    # One engine's tokens: a server's, of the same dtype and model.
    one = _complete(servers["prefill"], prompt, max_tokens=8, cache_prompt=False)
    common = ["-m", "servelm.cli", "generate", prompt, "--dtype", "float32",
              "--kernel-tuning", "off", "--temperature", "0", "--max-tokens", "8",
              "--kv-cache-memory", "32MiB", "--num-threads", "1"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # The static rendezvous on host 1 (rank 0 there, as features.md tells `serve` users);
    # host 1's rank listens on its route to it, host 2's on GLOO_SOCKET_IFNAME's interface.
    procs = [Proc(k, torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                  "static", "--rdzv-endpoint", f"{A}:29555", "--node-rank", str(k - 1),
                  "--master-addr", A, "--master-port", "29555",
                  *common, "--tensor-parallel-size", "2", "--no-shm-collectives",
                  env={"OMP_NUM_THREADS": "1", **({"GLOO_SOCKET_IFNAME": "eth0"} if k == 2
                                                  else {})})
             for k in (1, 2)]
    try:
        for p in procs:
            p.proc.wait(timeout=150)
        outs = [p.output() for p in procs]
        assert [p.proc.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
        text = one["choices"][0]["text"]
        assert text.strip() and text.strip() in outs[0]  # rank 0's, on host 1
    finally:
        for p in procs:
            p.stop()
