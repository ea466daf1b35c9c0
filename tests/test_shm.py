"""Shared-memory collectives between CPU ranks on one host (servelm.distributed.shm): sums
and gathers equal to the exact ones, the same bits on every rank, gloo for what does not
fit a slot, the segment's name gone once mapped, and a dead peer an error, not a hang."""

from __future__ import annotations

import datetime
import glob
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed import PrefixStore, TCPStore

from servelm.distributed import shm
from servelm.distributed.parallel_state import TPGroup

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs Linux x86-64 /dev/shm")

SLOT = 64 << 10  # small slots, so that a modest tensor already takes gloo
# The collectives' operands in turn: mixed sizes and dtypes; the last is 144 KiB: gloo.
SHAPES = [((1, 576), torch.float32), ((7, 576), torch.bfloat16), ((3, 100), torch.float32),
          ((64, 576), torch.float32)]
ROUNDS = 60


def _is_gather(i: int) -> bool:  # every fifth collective gathers to rank 0
    return i % 5 == 4


def _store(rank: int, world: int, port: int) -> TCPStore:
    torch.set_num_threads(1)
    return TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                    timeout=datetime.timedelta(seconds=60))


def _group(rank: int, world: int, store, name: str = "g", use_shm: bool = True) -> TPGroup:
    shm.SLOT_BYTES = SLOT  # this process's own copy of the module (a fork)
    return TPGroup(PrefixStore(name, store), rank, world, torch.device("cpu"),
                   hostname="127.0.0.1", shm=use_shm)


def _spawn(fn, world: int, *args) -> list[int | None]:
    """world processes forked from this one (nothing to import again), fn(rank, world, port,
    *args) in each; they only run single-threaded small ops, which fork safely."""
    ctx = mp.get_context("fork")
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def _data(rank: int, i: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _collectives(rank: int, world: int, port: int, out_dir: str) -> None:
    store = _store(rank, world, port)
    group = _group(rank, world, store)
    assert group.shm is not None
    off = _group(rank, world, store, "off", use_shm=False)  # KernelConfig.shm_collectives
    summed = off.all_reduce(torch.full((2,), float(rank + 1)))
    results = []
    # Many times over: slots of both parities reused, and a gather (whose other ranks do
    # not wait) right before all-reduces.
    for i in range(ROUNDS):
        shape, dtype = SHAPES[i % len(SHAPES)]
        t = _data(rank, i, shape, dtype)
        if _is_gather(i):
            parts = group.gather_to_rank0(t)
            results.append(None if parts is None else torch.stack([p.float() for p in parts]))
        else:
            results.append(group.all_reduce(t).clone())
    torch.save({"results": results, "shm_ops": group.shm.num_ops,
                "all_reduces": group.num_all_reduces, "off": (off.shm, summed.tolist())},
               os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_gather_are_exact_and_the_same_on_every_rank(world, tmp_path):
    before = set(glob.glob("/dev/shm/servelm-tp-*"))
    assert _spawn(_collectives, world, str(tmp_path)) == [0] * world
    assert set(glob.glob("/dev/shm/servelm-tp-*")) == before  # unlinked once mapped
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    total = float(sum(range(1, world + 1)))
    assert all(g["off"] == (None, [total, total]) for g in got)  # gloo, when asked
    for i in range(ROUNDS):
        shape, dtype = SHAPES[i % len(SHAPES)]
        inputs = [_data(r, i, shape, dtype) for r in range(world)]
        if _is_gather(i):
            assert torch.equal(got[0]["results"][i], torch.stack([x.float() for x in inputs]))
            assert all(g["results"][i] is None for g in got[1:])
            continue
        want = sum(x.float() for x in inputs)
        tol = 0 if dtype == torch.float32 and world == 2 else 1e-2
        assert torch.allclose(got[0]["results"][i].float(), want, atol=tol, rtol=tol)
        for g in got[1:]:  # the same bits everywhere: ranks must stay in step
            assert torch.equal(g["results"][i], got[0]["results"][i])
    big = sum(1 for i in range(ROUNDS) if SHAPES[i % len(SHAPES)][0] == (64, 576))
    assert big == 15
    for g in got:
        assert g["shm_ops"] == ROUNDS - big  # everything but the 144 KiB tensors went through shm
        assert g["all_reduces"] == ROUNDS - 12  # the rest are gathers


def _dies(rank: int, world: int, port: int, out_dir: str) -> None:
    group = _group(rank, world, _store(rank, world, port))
    group.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed worker would be
    t0 = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
        outcome = "returned"
    except shm.PeerGoneError as e:
        outcome = str(e)
    with open(os.path.join(out_dir, "outcome"), "w") as f:
        f.write(f"{outcome}\n{time.monotonic() - t0}")


def test_a_dead_peer_is_an_error_not_a_hang(tmp_path):
    _spawn(_dies, 2, str(tmp_path))
    outcome, seconds = (tmp_path / "outcome").read_text().split("\n")
    assert "is gone" in outcome and float(seconds) < 5


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
