"""Disaggregated prefill and decode (issue 56 item 3), below the servers: a pool's blocks as
bytes and back (scales of a quantised pool too); the block manager's import (shared where
cached, no leak); one engine's export imported by another, whose greedy tokens then equal a
cold run's while it computes only past the imported blocks; the transport (gloo and shared
memory, a refused layout, a receiver that dies); the server's kv_transfer_params checks;
and the router's split: long prompts prefilled elsewhere with their KV sent to the backend
that answers, short or cached ones not, a failed prefill only costing the recompute."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from fastapi import FastAPI

from servelm import LLM, SamplingParams
from servelm.distributed.kv_transfer import (KVReceiver, KVSender, KVTransferConfig,
                                             KVTransferError, layout_mismatch)
from servelm.engine.block_manager import BlockManager
from servelm.engine.model_runner import KVCache
from servelm.router.app import FAILED, LOCAL, REMOTE, _kv_host, prefill_body

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# ---- the pool's blocks as bytes ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_blocks_read_and_written_as_bytes(llm, dtype):
    cfg = llm.engine.model_config
    a = KVCache(cfg, 6, BS, dtype, torch.device("cpu"))
    b = KVCache(cfg, 6, BS, dtype, torch.device("cpu"))
    for r in a._regions:  # every region, the scales of an int8 pool included
        r.view(torch.uint8).copy_(torch.randint(0, 256, r.view(torch.uint8).shape,
                                                dtype=torch.uint8))
    assert a.layout() == b.layout() and a.block_bytes == KVCache.bytes_per_block(cfg, BS, dtype)
    data = a.read_blocks([4, 1, 2])
    assert data.dtype == torch.uint8 and data.numel() == 3 * a.block_bytes
    b.write_blocks([0, 5], data, rows=[1, 2])  # entries 1 and 2 of the three; the first unused
    for ra, rb in zip(a._regions, b._regions):
        assert torch.equal(rb[0].view(torch.uint8), ra[1].view(torch.uint8))
        assert torch.equal(rb[5].view(torch.uint8), ra[2].view(torch.uint8))
        assert not rb[1].view(torch.uint8).any()  # untouched
    with pytest.raises(ValueError, match="do not hold 3 blocks"):
        b.write_blocks([0, 1, 2], data[:-1])
    assert a.read_blocks([]).numel() == 0


def test_block_manager_import_shares_cached_blocks_and_leaks_nothing():
    bm = BlockManager(6, 4, enable_caching=True)
    ids = list(range(12))  # three blocks
    bm.allocate("r", 8)  # a request that computed the first two blocks
    bm.cache_full_blocks("r", ids, 8, "s")
    new, rows = bm.begin_import("imp", ids, "s")
    assert rows == [2] and len(new) == 1  # only the third block is written
    assert bm.block_table("imp")[:2] == bm.block_table("r")
    bm.end_import("imp", ids, "s")
    bm.free("r")
    assert bm.owners() == {} and bm.num_free_blocks == 6
    assert len(bm.find_cached_prefix([*ids, 99], "s")) == 3
    assert bm.find_cached_prefix([*ids, 99], "other") == []  # another salt: nothing
    # No room: None, nothing taken; a failed copy frees its blocks uncached.
    bm.allocate("big", 6 * 4)
    assert bm.begin_import("imp", list(range(50, 58)), None) is None
    bm.free("big")
    new, _ = bm.begin_import("imp", list(range(50, 58)), None)
    bm.end_import("imp", list(range(50, 58)), None, written=False)
    assert bm.find_cached_prefix(list(range(50, 59))) == [] and bm.num_free_blocks == 6
    # Off without a prefix cache, or for a partial block.
    assert BlockManager(4, 4).begin_import("imp", ids, None) is None
    assert bm.begin_import("imp", ids[:5], None) is None


def test_block_groups_import_only_the_pages_in_reach():
    """A pool in block groups (a full group, a windowed one of reach 8): a prefix of five
    4-token blocks travels as its five blocks and the windowed group's pages of its last
    two positions (prefix_pages); the receiver shares what it has cached, takes the rest,
    holds no page out of reach, caches the prefix and leaks nothing."""
    send, recv = (BlockManager(24, 4, enable_caching=True, groups=(8,)) for _ in range(2))
    ids = list(range(20))  # five blocks
    send.allocate("r", 21)
    send.cache_full_blocks("r", [*ids, 99], 21)
    hit = send.find_cached_prefix([*ids, 99])
    assert len(hit) == 5 and send.prefix_rows(5) == 5 + 2
    pages = send.prefix_pages(hit)
    assert pages == [*hit, *hit.groups[0][3:]]
    # The receiver holds the first two blocks already (its own request, freed).
    recv.allocate("own", 9)
    recv.cache_full_blocks("own", [*ids[:8], 99], 9)
    recv.free("own")
    new, rows = recv.begin_import("imp", ids)
    assert rows == [2, 3, 4, 5, 6] and len(new) == 5  # 3 blocks, 2 pages; 2 blocks shared
    assert recv.num_held("imp") == 5 + 2
    recv.end_import("imp", ids)
    assert recv.owners() == {} and recv.num_free_blocks == 24
    again = recv.find_cached_prefix([*ids, 99])
    assert len(again) == 5 and again.groups[0][3:] == new[3:]
    # Room for the blocks but not the pages (6 free of the 7): nothing taken.
    recv.allocate("hog", 9 * 4)  # 9 blocks and 9 pages
    assert recv.num_free_blocks == 6
    assert recv.begin_import("imp", list(range(50, 70))) is None
    recv.free("hog")
    assert recv.owners() == {} and recv.num_free_blocks == 24


# ---- one engine's prefix in another ----------------------------------------------------------


@pytest.fixture(scope="module")
def decode_llm():
    return LLM(dtype="float32", kv_cache_memory=64 << 20)


def _prompt(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def test_an_imported_prefix_gives_a_cold_runs_tokens(llm, decode_llm):
    ids = _prompt(llm, "A museum by the harbour keeps old maps of the northern islands. " * 6)
    assert len(ids) > 3 * BS
    cold = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    prefill, decode = llm.engine, decode_llm.engine
    assert prefill.kv_layout() == decode.kv_layout()
    n, data = prefill.export_prefix(ids, None)
    assert n == (len(ids) - 1) // BS * BS and data.numel() == n // BS * decode.executor.kv_cache.block_bytes
    assert prefill.export_prefix(ids, "another salt")[0] == 0
    assert decode.import_prefix(ids[:n], None, data) == n
    free = decode.block_manager.num_free_blocks
    assert decode.import_prefix(ids[:n], None, data) == n  # again: all shared, none written
    assert decode.block_manager.num_free_blocks == free and decode.block_manager.owners() == {}
    before = decode.stats.num_prefill_tokens
    out = decode_llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == n
    assert decode.stats.num_prefill_tokens - before == len(ids) - n  # only past the import
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    with pytest.raises(ValueError, match="not whole blocks"):
        decode.import_prefix(ids[:n - 1], None, data)
    with pytest.raises(ValueError, match="bytes are not"):
        decode.import_prefix(ids[:n], None, data[:-1])


def test_a_pool_that_cannot_take_the_prefix_imports_nothing(llm, decode_llm):
    ids = _prompt(llm, "The library on the hill lends old maps and letters to visitors. " * 5)
    llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    n, data = llm.engine.export_prefix(ids, None)
    bm = decode_llm.engine.block_manager
    bm.allocate("hog", (bm.num_free_blocks - 1) * BS)  # every block but one is held
    try:
        assert decode_llm.engine.import_prefix(ids[:n], None, data) == 0
        assert set(bm.owners()) == {"hog"}
    finally:
        bm.free("hog")
    off = BlockManager(4, BS)
    decode_llm.engine.block_manager, saved = off, bm  # a pool without a prefix cache
    try:
        assert "prefix caching is off" in decode_llm.engine.kv_transfer_check()
    finally:
        decode_llm.engine.block_manager = saved
    assert decode_llm.engine.kv_transfer_check() is None


# ---- the transport ---------------------------------------------------------------------------


LAYOUT = {"architecture": "Llama", "block_size": 16, "regions": [["float32", [16, 3, 64]]]}


class Imports:
    def __init__(self, answer=None):
        self.calls, self.answer = [], answer

    def __call__(self, ids, salt, data):
        self.calls.append((list(ids), salt, data.clone()))
        if isinstance(self.answer, Exception):
            raise self.answer
        return len(ids) if self.answer is None else self.answer


@pytest.mark.parametrize("shm", [True, False])
def test_transfers_arrive_whole_over_gloo_and_shared_memory(shm):
    imports = Imports()
    rx = KVReceiver("127.0.0.1", 0, LAYOUT, imports, shm=True, timeout=10)
    tx = KVSender(LAYOUT, shm=shm, timeout=10)
    try:
        for n in (32, 16):
            data = torch.randint(0, 256, (n * 1000,), dtype=torch.uint8)
            got = tx.send("127.0.0.1", rx.port, list(range(n)), "salt", data)
            assert got["tokens"] == got["cached_tokens"] == n and got["bytes"] == data.numel()
            assert got["transport"] == ("shm" if shm else "gloo")
            ids, salt, arrived = imports.calls[-1]
            assert ids == list(range(n)) and salt == "salt" and torch.equal(arrived, data)
        assert tx.stats.report()["transfers"] == 2 and tx.stats.report()["pairs"] == 1
        assert rx.stats.report()["tokens"] == 48
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("servelm-kv-")]
        imports.answer = RuntimeError("no engine")  # an import that fails is the sender's error
        with pytest.raises(KVTransferError, match="failed to import"):
            tx.send("127.0.0.1", rx.port, [1] * 16, None, torch.zeros(10, dtype=torch.uint8))
        assert tx.stats.failures == 1 and rx.stats.failures == 1
    finally:
        rx.stop()


def test_a_receiver_of_another_layout_refuses_with_what_differs():
    rx = KVReceiver("127.0.0.1", 0, LAYOUT, Imports(), timeout=10)
    other = {**LAYOUT, "regions": [["bfloat16", [16, 3, 64]]]}
    with pytest.raises(KVTransferError, match="regions"):
        KVSender(other, timeout=10).send("127.0.0.1", rx.port, [1] * 16, None,
                                         torch.zeros(8, dtype=torch.uint8))
    rx.stop()
    assert layout_mismatch(LAYOUT, LAYOUT) is None
    assert "block_size: 32 there, 16 here" in layout_mismatch(LAYOUT, {**LAYOUT, "block_size": 32})


_RECEIVER = """
import sys, time, torch
from servelm.distributed.kv_transfer import KVReceiver
rx = KVReceiver("127.0.0.1", 0, {layout!r}, lambda ids, salt, data: len(ids), timeout=10)
print(rx.port, flush=True)
time.sleep(600)
"""


def test_a_receiver_that_dies_fails_the_next_send_at_once_then_another_takes_over():
    def start():
        p = subprocess.Popen([sys.executable, "-c", _RECEIVER.format(layout=LAYOUT)],
                             stdout=subprocess.PIPE, text=True)
        return p, int(p.stdout.readline())

    proc, port = start()
    tx = KVSender(LAYOUT, shm=False, timeout=5)
    data = torch.ones(4096, dtype=torch.uint8)
    try:
        assert tx.send("127.0.0.1", port, [1] * 16, None, data)["cached_tokens"] == 16
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            tx.send("127.0.0.1", port, [1] * 16, None, data)
        assert time.monotonic() - t0 < 8  # found out, not hung
        proc, port = start()  # a restarted receiver: the sender connects again
        assert tx.send("127.0.0.1", port, [1] * 16, None, data)["cached_tokens"] == 16
    finally:
        proc.kill()
        proc.wait()


def test_transfer_config_errors():
    with pytest.raises(ValueError, match="--role"):
        KVTransferConfig(role="both-ish")
    with pytest.raises(ValueError, match="--role prefill"):
        KVTransferConfig(role="prefill", port=0)
    assert KVTransferConfig(role="decode").receives and not KVTransferConfig(role="decode").sends
    assert not KVTransferConfig().receives and KVTransferConfig(port=9).receives
    assert KVTransferConfig(role="prefill").sends and not KVTransferConfig().sends


def test_kv_transfer_params_are_checked_field_by_field():
    from servelm.server.disaggregation import Disaggregation
    from servelm.server.errors import APIError

    d = Disaggregation.__new__(Disaggregation)
    d.config, d.sender, d.why_not = KVTransferConfig(role="prefill"), object(), None
    ok = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 9000}
    assert d.target(ok, False, 1, None) == ("10.0.0.2", 9000)
    assert d.target({"do_remote_prefill": True}, True, 3, None) is None
    for params, stream, prompts, lora, param in (
            ({**ok, "remote_port": "9000"}, False, 1, None, "kv_transfer_params.remote_port"),
            ({**ok, "engine_id": "x"}, False, 1, None, "kv_transfer_params.engine_id"),
            ({"do_remote_decode": True}, False, 1, None, "kv_transfer_params.remote_host"),
            ({**ok, "remote_port": 0}, False, 1, None, "kv_transfer_params.remote_port"),
            (ok, True, 1, None, "stream"), (ok, False, 2, None, "prompt"),
            (ok, False, 1, "adapter", "model")):
        with pytest.raises(APIError) as e:
            d.target(params, stream, prompts, lora)
        assert e.value.status == 400 and e.value.param == param
    for role in ("decode", "both"):  # only a prefill server connects where a client says
        d.config, d.sender = KVTransferConfig(role=role), None
        with pytest.raises(APIError, match=f"its role is {role}"):
            d.target(ok, False, 1, None)


# ---- the router's split ----------------------------------------------------------------------


def test_prefill_body_and_receiver_address():
    body = json.loads(prefill_body({"model": "m", "prompt": "x", "max_tokens": 99, "stream": True,
                                    "stream_options": {"include_usage": True}, "n": 3,
                                    "min_tokens": 5, "temperature": 0.7}, "10.0.0.2", 9))
    assert body == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False,
                    "temperature": 0.7, "kv_transfer_params": {
                        "do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 9}}
    assert _kv_host("0.0.0.0", "http://10.0.0.2:8000") == "10.0.0.2"
    assert _kv_host("10.0.0.9", "http://10.0.0.2:8000") == "10.0.0.9"
    assert _kv_host("127.0.0.1", "http://127.0.0.1:8000") == "127.0.0.1"


def _backend(name: str, log: list, kv_port: int | None = None, fail: bool = False) -> FastAPI:
    """test_router's fake backend, reporting a KV receiver (a decode server) or answering
    kv_transfer_params (a prefill server; fail: with an error)."""
    from test_router import fake_backend

    app = fake_backend(name, log=log)
    receiver = None if kv_port is None else {"host": "127.0.0.1", "port": kv_port}
    app.state.stats = {"requests": {"running_tokens": 0, "waiting_tokens": 0},
                       "roofline": {"ridge_tokens": 12.5}, "kv_transfer": {"receiver": receiver}}

    def reply(body: dict) -> dict:
        if fail:
            return {"kv_transfer_params": {"error": "the decode server went away"}}
        if "kv_transfer_params" in body:
            return {"kv_transfer_params": {"tokens": len(body["prompt"]) // BS * BS}}
        return {"backend": name}

    app.state.reply = reply
    return app


SPLIT = dict(backends=("http://d",), prefill_backends=("http://p",))


def test_router_prefills_long_prompts_elsewhere_and_never_loses_a_request():
    from test_router import _settle, _with_router

    def run(fail: bool, min_tokens):
        log: list = []
        apps = {"d": _backend("d", log, kv_port=4321), "p": _backend("p", log, fail=fail)}

        async def body(router, client):
            await _settle(router, lambda: router.backends[0].kv_port == 4321)
            assert router.prefill_threshold(router.backends[0]) == (min_tokens or 64)
            long, short = list(range(100, 300)), list(range(100, 120))
            for prompt in (long, short):
                r = await client.post("/v1/completions", json={"prompt": prompt,
                                                               "max_tokens": 50, "stream": False})
                assert r.json() == {"backend": "d"}
            stats = (await client.get("/v1/stats")).json()
            return log, router.prefilled, stats

        return asyncio.run(_with_router(apps, body, prefill_min_tokens=min_tokens, **SPLIT))

    log, prefilled, stats = run(False, None)
    assert [name for name, *_ in log] == ["p", "d", "d"]  # the long prompt first ran on p
    sent = log[0][1]
    assert sent["max_tokens"] == 1 and sent["kv_transfer_params"] == {
        "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": 4321}
    assert log[1][1] == {"prompt": list(range(100, 300)), "max_tokens": 50, "stream": False}
    assert prefilled == {REMOTE: 1, LOCAL: 1, FAILED: 0}
    assert stats["router"]["prefilled"] == prefilled
    assert [b["role"] for b in stats["backends"]] == ["decode", "prefill"]
    # A prefill that fails still gets its answer (the decode backend computes the prompt);
    # a lower threshold splits the short prompt too.
    log, prefilled, _ = run(True, 8)
    assert [name for name, *_ in log] == ["p", "d", "p", "d"]
    assert prefilled == {REMOTE: 0, LOCAL: 0, FAILED: 2}


def test_a_prefill_backend_that_stops_answering_costs_seconds_not_the_request():
    from test_router import _settle, _with_router

    log: list = []
    apps = {"d": _backend("d", log, kv_port=4321), "p": _backend("p", log)}

    async def hang(body):  # takes the prompt, then answers nothing, health included
        apps["p"].state.healthy = False
        await asyncio.sleep(3600)

    apps["p"].state.reply = hang

    async def body(router, client):
        await _settle(router, lambda: router.backends[0].kv_port == 4321)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": list(range(100, 140)),
                                                       "max_tokens": 5})
        assert r.json() == {"backend": "d"} and time.monotonic() - t0 < 5
        assert router.prefilled[FAILED] == 1 and not router.prefills[0].view.up
        assert router.prefills[0].view.inflight == 0

    asyncio.run(_with_router(apps, body, prefill_min_tokens=8, health_interval=0.1, **SPLIT))


def test_router_and_serve_flags():
    from servelm.cli import main
    from servelm.router.replicas import replica_argv
    from servelm.router.serve import parse_split

    assert parse_split("2:3") == (2, 3)
    for bad in ("2", "0:1", "a:b"):
        with pytest.raises(ValueError, match="--disaggregate"):
            parse_split(bad)
    argv = ["serve", "m.gguf", "--disaggregate", "--port", "9", "--prefill-min-tokens", "5"]
    assert replica_argv(argv) == ["serve", "m.gguf"]
    assert replica_argv(["serve", "--disaggregate", "1:2", "m.gguf"]) == ["serve", "m.gguf"]
    assert main(["serve", "--disaggregate", "--dp", "2"]) == 2
    assert main(["router", "--prefill", "http://a:1"]) == 2  # no backend to answer
    assert main(["router", "--backend", "http://a:1", "--prefill", "http://a:1"]) == 2
    assert main(["router", "--decode", "http://a:1", "--prefill", "http://b:1",
                 "--prefill-min-tokens", "0"]) == 2
