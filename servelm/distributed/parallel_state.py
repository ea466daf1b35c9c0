"""Tensor-parallel process groups on PyTorch's own collectives: gloo on CPU, NCCL on CUDA.

The groups are built straight on a c10d store (no torch.distributed default group), so a
process may hold several engines one after another and TP=1 never touches
torch.distributed. Each rank has two groups:

- `compute`: the model's collectives inside a step (all-reduce of row-parallel outputs,
  gather of the vocabulary-parallel logits). gloo on CPU, NCCL on CUDA. Its timeout
  (SERVELM_TP_TIMEOUT_S, default 300 s) turns a hung peer into an error. CPU ranks that
  all live on one host run these through shared memory instead (servelm.distributed.shm,
  KernelConfig.shm_collectives), gloo taking only what does not fit its slots.
- `control` (gloo, CPU tensors): rank 0 broadcasts each step's batch metadata on it.
  Workers wait on it while the server idles, so its timeout is long; a peer that dies
  closes its sockets, which fails the wait at once whatever the timeout.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed import (AllreduceOptions, BroadcastOptions, GatherOptions,
                               PrefixStore, ProcessGroupGloo, Store, TCPStore)

from servelm.distributed.shm import ShmChannel

_HEADER = 4096  # bytes broadcast for every control message; longer ones take a second broadcast
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def compute_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("SERVELM_TP_TIMEOUT_S", "300")))


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (or any env:// launcher) tells each process about its place."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT


def torchrun_env() -> TorchrunEnv | None:
    """The launcher's environment, or None when this process was not started by one."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(rank=int(env["RANK"]), world_size=world,
                       local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                       master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def torchrun_store(env: TorchrunEnv) -> Store:
    """The launcher's store (rank 0 hosts it unless torchrun's agent already does)."""
    store = TCPStore(env.master_addr, env.master_port, env.world_size,
                     is_master=env.rank == 0 and not env.agent_store,
                     timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    return PrefixStore(f"servelm-tp/{os.environ.get('TORCHELASTIC_RUN_ID', 'env')}", store)


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port (no packet is sent); loopback when
    there is none."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def gloo_address(env: TorchrunEnv) -> str | None:
    """Where a launched rank's gloo groups listen: None where GLOO_SOCKET_IFNAME names the
    interfaces; else this host's address on the route to the rendezvous host, which the
    other hosts reach even where this host's name resolves to loopback (gloo's default)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return route_address(env.master_addr, env.master_port)


def _gloo(store: Store, rank: int, world: int, timeout: datetime.timedelta,
          hostname: str | None) -> ProcessGroupGloo:
    opts = ProcessGroupGloo._Options()
    # Spawned workers all live on this host: bind to loopback. Under a launcher: the
    # address gloo_address chose, or GLOO_SOCKET_IFNAME's interfaces.
    if hostname:
        devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    else:
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        devices = ([ProcessGroupGloo.create_device(interface=n) for n in names]
                   or [ProcessGroupGloo.create_default_device()])
    opts._devices = devices
    opts._timeout = timeout
    return ProcessGroupGloo(store, rank, world, opts)


def _nccl(store: Store, rank: int, world: int, timeout: datetime.timedelta):
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world, opts)


class TPGroup:
    """This rank's place in the tensor-parallel world and its two process groups."""

    def __init__(self, store: Store, rank: int, world: int, device: torch.device,
                 hostname: str | None = None, shm: bool = True):
        self.rank, self.world, self.device = rank, world, device
        self.store = store
        self.control = _gloo(PrefixStore("control", store), rank, world, _CONTROL_TIMEOUT,
                             hostname)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.compute = _nccl(PrefixStore("compute", store), rank, world, compute_timeout())
        else:
            self.compute = _gloo(PrefixStore("compute", store), rank, world, compute_timeout(),
                                 hostname)
        self.num_all_reduces = 0     # counters, for the benchmark's communication figures
        self.all_reduce_bytes = 0
        self.shm: ShmChannel | None = None
        if device.type == "cpu" and shm:
            self.shm = ShmChannel.connect(PrefixStore("shm", store), rank, world,
                                          self.control_all_reduce_max,
                                          compute_timeout().total_seconds())

    # ---- the model's collectives (compute group) ----------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self.num_all_reduces += 1
        self.all_reduce_bytes += t.numel() * t.element_size()
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        self.compute.allreduce([t], AllreduceOptions()).wait()
        return t

    def gather_to_rank0(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape everywhere) on rank 0, in rank order; None elsewhere."""
        if self.shm is not None and self.shm.fits(t):
            return self.shm.gather_to_rank0(t)
        opts = GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            out = [[torch.empty_like(t) for _ in range(self.world)]]
            self.compute.gather(out, [t], opts).wait()
            return out[0]
        self.compute.gather([], [t], opts).wait()
        return None

    # ---- control messages from rank 0 (control group) -----------------------------------

    def _bcast(self, t: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.control.broadcast([t], opts).wait()

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` (pickled) on every rank. One 4 KiB broadcast for a decode step's
        metadata; a longer message (a long prompt chunk) takes a second one."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = min(len(data), _HEADER - 8)
            buf = np.zeros(_HEADER, dtype=np.uint8)
            buf[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
            buf[8:8 + head] = np.frombuffer(data, dtype=np.uint8, count=head)
            self._bcast(torch.from_numpy(buf))
            if len(data) > head:
                rest = np.frombuffer(data, dtype=np.uint8, offset=head).copy()
                self._bcast(torch.from_numpy(rest))
            return obj
        buf = torch.empty(_HEADER, dtype=torch.uint8)
        self._bcast(buf)
        raw = buf.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        head = min(n, _HEADER - 8)
        data = raw[8:8 + head]
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self._bcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def control_all_reduce_max(self, value: int) -> int:
        """Max of one integer over the ranks (start-up handshakes), on the control group."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp.MAX
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    # ---- errors -------------------------------------------------------------------------

    def report_error(self, message: str) -> None:
        """Leave this rank's last words in the store, for rank 0's error message."""
        try:
            self.store.set(f"error/{self.rank}", message[-2000:])
        except Exception:  # the store may be gone with rank 0
            pass

    def reported_errors(self) -> dict[int, str]:
        out = {}
        for r in range(1, self.world):
            try:
                if self.store.check([f"error/{r}"]):
                    out[r] = self.store.get(f"error/{r}").decode(errors="replace")
            except Exception:
                pass
        return out
