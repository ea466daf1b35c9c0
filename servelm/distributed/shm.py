"""The model's collectives between CPU ranks on one host, through one shared-memory segment.

gloo's all-reduce costs about 2 ms whatever its size on a small VM (its I/O threads wake
through the scheduler), and a decode step runs two a layer: most of a tensor-parallel
step's time. Ranks on one host instead post their tensor into their own slot of a shared
segment, publish the operation's sequence number, wait (spinning, then yielding the CPU)
until every rank has published it, and sum the slots themselves, in rank order, so every
rank gets the same bits. Tensors larger than a slot take gloo, as does every rank when any
one of them cannot map the segment (another host, another PID namespace, no /dev/shm).

Slots are double-buffered: operation k writes parity k % 2. Before writing, a rank waits
until every rank has published k - 1, which each does only after reading operation k - 2's
slots (the same parity), so a slot is never overwritten while someone reads it. A rank that
waits checks, every millisecond or so, that its peers' processes still exist and that the
compute timeout has not passed, so a dead peer is an error, never a hang.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import time

import torch

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20   # per rank and parity: a decode step's activations, a batch's logits
_ALIGN = 64
_CHECK_EVERY = 1024    # waiting iterations between liveness / timeout checks
_SPIN = 64             # iterations before each further one yields the CPU


class PeerGoneError(RuntimeError):
    """A peer rank's process exited, or did not answer within the compute timeout."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class ShmChannel:
    """All-reduce and gather-to-rank-0 of CPU tensors among this host's ranks."""

    def __init__(self, buf: torch.Tensor, rank: int, world: int, pids: list[int],
                 slot_bytes: int, timeout_s: float):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.timeout_s = timeout_s
        self._buf = buf  # keeps the mapping alive
        header = _header_bytes(world)
        self._flags = buf[:8 * world].view(torch.int64).numpy()
        self._pids = [p for r, p in enumerate(pids) if r != rank]
        self._slots = [[buf[header + (p * world + r) * slot_bytes:
                             header + (p * world + r + 1) * slot_bytes]
                        for r in range(world)] for p in range(2)]
        self._seq = int(self._flags[rank])
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}
        self.num_ops = 0

    # ---- set-up ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, store, rank: int, world: int, vote, timeout_s: float,
                slot_bytes: int | None = None) -> ShmChannel | None:
        """Every rank calls this at once. Rank 0 creates the segment and names it in the
        store; each rank maps it and checks it sees the others' processes; `vote(flag)` (the
        control group's all-reduce of max) makes the choice unanimous. None: use gloo."""
        slot_bytes = slot_bytes or SLOT_BYTES
        size = _header_bytes(world) + 2 * world * slot_bytes
        at = _token_at(world)
        path, token, buf = "", "", None
        if rank == 0:
            try:
                path, token = _create(size, at)
            except OSError as e:  # no room in /dev/shm, say
                logger.info("shared-memory collectives unavailable: %s", e)
            store.set("shm/path", f"{path}\n{token}")  # always: the others wait for it
        else:
            path, token = store.get("shm/path").decode().split("\n")
        try:
            if path:
                buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                if buf[at:at + len(token)].numpy().tobytes() != token.encode():
                    buf = None  # a file of that name, but not rank 0's segment
                else:
                    buf[8 * world:16 * world].view(torch.int64)[rank] = os.getpid()
        except Exception as e:  # noqa: BLE001 - any failure means gloo, decided together
            logger.info("shared-memory collectives unavailable on rank %d: %s", rank, e)
            buf = None
        try:
            if vote(0 if buf is not None else 1):  # someone could not map it
                return None
        finally:
            if rank == 0 and path:
                os.unlink(path)  # every rank has mapped it or given up: the name can go
        pids = buf[8 * world:16 * world].view(torch.int64).tolist()
        if vote(0 if all(_alive(p) for p in pids) else 1):  # another PID namespace
            return None
        return cls(buf, rank, world, pids, slot_bytes, timeout_s)

    # ---- collectives ----------------------------------------------------------------------

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def _post(self, t: torch.Tensor) -> int:
        k = self._seq + 1
        self._wait(k - 1)  # every rank has read operation k - 2's slots (parity k % 2)
        self._views(k, t)[self.rank].copy_(t)
        self._flags[self.rank] = k  # after the data: x86 stores are seen in order
        self._seq = k
        self.num_ops += 1
        return k

    def _views(self, k: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of parity k % 2 as a tensor shaped like t (cached: making the
        views costs more than copying a decode step's activations)."""
        key = (k % 2, t.dtype, t.shape)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 256:
                self._view_cache.clear()
            n = t.numel() * t.element_size()
            views = [slot[:n].view(t.dtype).view(t.shape) for slot in self._slots[k % 2]]
            self._view_cache[key] = views
        return views

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (in rank order: every rank gets the same bits)."""
        k = self._post(t.contiguous())
        self._wait(k)
        views = self._views(k, t)
        if self.world > 2 and t.dtype != torch.float32:
            acc = views[0].float()
            for v in views[1:]:
                acc += v
            t.copy_(acc)
        else:
            torch.add(views[0], views[1], out=t)
            for v in views[2:]:
                t.add_(v)
        return t

    def gather_to_rank0(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        k = self._post(t.contiguous())
        if self.rank != 0:
            return None
        self._wait(k)
        return [v.clone() for v in self._views(k, t)]

    def _wait(self, k: int) -> None:
        flags = self._flags
        if flags.min() >= k:
            return
        n, deadline = 0, None
        while flags.min() < k:
            n += 1
            if n % _CHECK_EVERY == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    raise PeerGoneError(f"tensor-parallel ranks did not reach collective {k} "
                                        f"within {self.timeout_s:.0f} s")
                for pid in self._pids:
                    if not _alive(pid):
                        raise PeerGoneError(f"tensor-parallel peer process {pid} is gone")
            if n > _SPIN:
                os.sched_yield()


def available() -> bool:
    """Whether this host can hold the segment: Linux with /dev/shm, and x86-64, whose
    total store order makes a rank's data visible before the flag it writes after it."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm"))


def _header_bytes(world: int) -> int:
    raw = 16 * world + 64  # flags, pids, the token
    return -(-raw // _ALIGN) * _ALIGN


def _token_at(world: int) -> int:
    return 16 * world


def _create(size: int, token_at: int) -> tuple[str, str]:
    """A new segment in /dev/shm, its space reserved (tmpfs would otherwise SIGBUS on a
    page it cannot back), zeroed, with a random token that proves it is this one."""
    import tempfile

    if not available():
        return "", ""
    token = secrets.token_hex(16)
    fd, path = tempfile.mkstemp(prefix="servelm-tp-", dir="/dev/shm")
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token.encode(), token_at)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, token
