"""A prompt's KV blocks sent from a prefill engine to a decode engine (disaggregated serving),
over torch.distributed point-to-point (gloo, on any network), or through a file in shared
memory when both engines are on one host.

A receiver (a decode server's) owns a TCPStore on its KV-transfer port. A sender connects
once per receiver: it takes a pair number from the store, writes its hello (its engine's KV
layout, the address it reached the receiver at, and a probe file in /dev/shm) and reads the
receiver's verdict: refused, naming what differs between the two engines' layouts; or
accepted, with shared memory when the receiver could read the probe (one host). Both then
form a two-rank gloo group under the pair's own prefix of the store. A transfer is

    sender -> receiver   header (int64: meta bytes, data bytes; 0 data bytes: shared memory)
                         meta (JSON: the token ids, the cache salt, the shared-memory file)
                         data (KVCache.read_blocks' bytes), unless in shared memory
    receiver -> sender   ack (int64: tokens now cached there; 0: no room, -1: failed)

one at a time per pair (a lock); the receiver serves each pair on a thread of its own and
imports through `import_fn` (the engine thread's LLMEngine.import_prefix). A sender's pair
that fails is dropped and the next transfer connects again; a peer that goes away closes
its sockets, which fails the other side's wait at once rather than at a timeout.

Nothing here authenticates a sender: the port is for a trusted network (it binds to
loopback unless told otherwise), as vLLM's and SGLang's KV connectors are.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from servelm.distributed.parallel_state import route_address

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
SHM_DIR = "/dev/shm"
_IDLE = datetime.timedelta(days=7)  # a receiver's wait for its sender's next transfer


class KVTransferError(RuntimeError):
    """A transfer could not be made: the receiver refused the pair or a peer went away."""


@dataclass(frozen=True)
class KVTransferConfig:
    """A server's part in disaggregated serving (its --role and --kv-transfer-* flags).

    role: prefill (sends a finished prompt's KV where a request asks: kv_transfer_params;
    only such a server connects where a client says), decode (receives KV on host:port into
    its prefix cache), both (neither, unless a port is given: then it receives). port 0: any
    free port (GET /v1/stats tells which). shm: use shared memory with a receiver on this
    host. timeout: seconds a connection or transfer may take.
    """

    role: str = "both"
    host: str = "127.0.0.1"
    port: int | None = None
    shm: bool = True
    timeout: float = 30.0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError(f"--kv-transfer-port must be in [0, 65535], got {self.port}")
        if self.role == "prefill" and self.port is not None:
            raise ValueError("--kv-transfer-port opens a receiver, which a --role prefill "
                             "server does not have")
        if not self.timeout > 0:
            raise ValueError(f"the KV transfer timeout must be > 0, got {self.timeout}")

    @property
    def sends(self) -> bool:
        return self.role == "prefill"

    @property
    def receives(self) -> bool:
        return self.role == "decode" or self.port is not None


def layout_mismatch(mine: dict, theirs: dict) -> str | None:
    """What differs between two engines' KV layouts (LLMEngine.kv_layout), or None."""
    diffs = [f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here"
             for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if not diffs:
        return None
    return "the two engines' KV blocks differ (" + "; ".join(diffs) + ")"


def _group(store, rank: int, address: str, timeout: datetime.timedelta) -> ProcessGroupGloo:
    """A two-rank gloo group over `store`, this rank listening on `address`."""
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = timeout
    return ProcessGroupGloo(store, rank, 2, opts)


def _unlink(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


@dataclass
class TransferStats:
    """Counters of one side's transfers (/v1/stats, /metrics)."""

    transfers: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    pairs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, tokens: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers += 1
            self.tokens += tokens
            self.bytes += nbytes
            self.seconds += seconds

    def failed(self) -> None:
        with self._lock:
            self.failures += 1

    def report(self) -> dict:
        with self._lock:
            return {"transfers": self.transfers, "tokens": self.tokens, "bytes": self.bytes,
                    "seconds": round(self.seconds, 6), "failures": self.failures,
                    "pairs": self.pairs}


class _SenderPair:
    """The sender's side of one connection to a receiver."""

    def __init__(self, host: str, port: int, layout: dict, shm: bool, timeout: float):
        wait = datetime.timedelta(seconds=timeout)
        try:
            self.store = TCPStore(host, port, None, False, wait)
        except Exception as e:  # refused, unreachable, or no answer within the timeout
            raise KVTransferError(f"cannot reach the KV receiver at {host}:{port}: {e}") from None
        n = self.store.add("pairs", 1)
        self.token = secrets.token_hex(8)
        probe = None
        if shm and os.path.isdir(SHM_DIR):
            probe = os.path.join(SHM_DIR, f"servelm-kv-probe-{self.token}")
            try:
                with open(probe, "w") as f:
                    f.write(self.token)
            except OSError:
                probe = None
        local = route_address(host, port)
        try:
            self.store.set(f"hello/{n}", json.dumps({
                "layout": layout, "receiver_host": host, "probe": probe, "token": self.token}))
            verdict = json.loads(self.store.get(f"verdict/{n}"))
        except Exception as e:
            raise KVTransferError(f"the KV receiver at {host}:{port} did not answer: {e}") from None
        finally:
            _unlink(probe)
        if verdict.get("error"):
            raise KVTransferError(f"the KV receiver at {host}:{port} refused: {verdict['error']}")
        self.shm = bool(verdict.get("shm"))
        self.group = _group(PrefixStore(f"pair/{n}/", self.store), 0, local, wait)
        self.lock = threading.Lock()
        self.seq = 0

    def send(self, token_ids: list[int], salt: str | None, data: torch.Tensor) -> int:
        with self.lock:
            self.seq += 1
            path = None
            try:
                if self.shm:
                    path = os.path.join(SHM_DIR, f"servelm-kv-{self.token}-{self.seq}")
                    with open(path, "wb") as f:
                        f.write(memoryview(data.numpy()))
                meta = json.dumps({"tokens": token_ids, "salt": salt, "shm": path,
                                   "bytes": data.numel()}).encode()
                header = torch.tensor([len(meta), 0 if path else data.numel()], dtype=torch.int64)
                g = self.group
                g.send([header], 1, 0).wait()
                g.send([torch.frombuffer(bytearray(meta), dtype=torch.uint8)], 1, 1).wait()
                if path is None and data.numel():
                    g.send([data], 1, 2).wait()
                ack = torch.empty(2, dtype=torch.int64)
                g.recv([ack], 1, 3).wait()
                return int(ack[0])
            finally:
                _unlink(path)  # the receiver has read it (or will not)


class KVSender:
    """A prefill server's connections to receivers, made on first use (host, port)."""

    def __init__(self, layout: dict, shm: bool = True, timeout: float = 30.0):
        self.layout, self.shm, self.timeout = layout, shm, timeout
        self.stats = TransferStats()
        self._pairs: dict[tuple[str, int], _SenderPair] = {}
        self._lock = threading.Lock()

    def send(self, host: str, port: int, token_ids: list[int], salt: str | None,
             data: torch.Tensor) -> dict:
        """Send a prefix's KV (blocking: run it off the event loop); returns what the
        receiver cached. KVTransferError when it could not."""
        t0 = time.perf_counter()
        try:
            pair = self._pair(host, port)
            try:
                got = pair.send(token_ids, salt, data)
            except Exception as e:  # the receiver went away: connect again next time
                with self._lock:
                    if self._pairs.get((host, port)) is pair:
                        del self._pairs[(host, port)]
                raise KVTransferError(f"sending KV to {host}:{port} failed: {e}") from None
        except KVTransferError:
            self.stats.failed()
            raise
        seconds = time.perf_counter() - t0
        if got < 0:
            self.stats.failed()
            raise KVTransferError(f"the KV receiver at {host}:{port} failed to import the "
                                  f"blocks (its log says why)")
        self.stats.add(len(token_ids), data.numel(), seconds)
        return {"tokens": len(token_ids), "cached_tokens": got, "bytes": data.numel(),
                "transport": "shm" if pair.shm else "gloo", "seconds": round(seconds, 6)}

    def _pair(self, host: str, port: int) -> _SenderPair:
        with self._lock:
            pair = self._pairs.get((host, port))
        if pair is None:
            pair = _SenderPair(host, port, self.layout, self.shm, self.timeout)
            with self._lock:
                pair = self._pairs.setdefault((host, port), pair)
                self.stats.pairs = len(self._pairs)
        return pair


class KVReceiver:
    """A decode server's listener: import_fn(token_ids, salt, data) -> tokens cached (the
    engine thread's import, waited for), called on each pair's thread."""

    def __init__(self, host: str, port: int, layout: dict, import_fn, shm: bool = True,
                 timeout: float = 30.0):
        self.layout, self.import_fn, self.shm = layout, import_fn, shm
        self.timeout = datetime.timedelta(seconds=timeout)
        try:
            self.store = TCPStore(host, port, None, True, self.timeout, wait_for_workers=False)
        except Exception as e:
            raise ValueError(f"cannot listen for KV transfers on {host}:{port}: {e}") from None
        self.host, self.port = host, self.store.port
        self.stats = TransferStats()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="servelm-kv-accept", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _accept(self) -> None:
        seen = 0
        while not self._stop.wait(0.02):
            try:
                total = int(self.store.add("pairs", 0))
            except Exception:
                logger.exception("KV receiver: the store failed; no more transfers")
                return
            while seen < total:
                seen += 1
                threading.Thread(target=self._serve, args=(seen,), daemon=True,
                                 name=f"servelm-kv-pair-{seen}").start()

    def _serve(self, n: int) -> None:
        try:
            self.store.wait([f"hello/{n}"], self.timeout)
            hello = json.loads(self.store.get(f"hello/{n}"))
        except Exception:
            return  # a sender that went away before its hello
        why = layout_mismatch(self.layout, hello.get("layout") or {})
        shm = bool(self.shm and hello.get("probe") and _read(hello["probe"]) == hello.get("token"))
        self.store.set(f"verdict/{n}", json.dumps({"error": why, "shm": shm}))
        if why:
            logger.warning("KV receiver: refused a sender: %s", why)
            return
        try:
            group = _group(PrefixStore(f"pair/{n}/", self.store), 1, hello["receiver_host"],
                           _IDLE)
        except Exception:
            logger.exception("KV receiver: could not connect pair %d", n)
            return
        with self.stats._lock:
            self.stats.pairs += 1
        logger.info("KV receiver: sender %d connected (%s)", n, "shared memory" if shm else "gloo")
        try:
            while not self._stop.is_set():
                self._receive(group)
        except Exception as e:  # the sender went away (its sockets closed)
            logger.info("KV receiver: sender %d gone (%s)", n, e)
        finally:
            with self.stats._lock:
                self.stats.pairs -= 1

    def _receive(self, group: ProcessGroupGloo) -> None:
        header = torch.empty(2, dtype=torch.int64)
        group.recv([header], 0, 0).wait()
        t0 = time.perf_counter()
        meta_bytes = torch.empty(int(header[0]), dtype=torch.uint8)
        group.recv([meta_bytes], 0, 1).wait()
        meta = json.loads(bytes(meta_bytes.numpy()))
        nbytes = int(meta["bytes"])
        if meta.get("shm"):
            data = (torch.from_file(meta["shm"], shared=False, size=nbytes, dtype=torch.uint8)
                    if nbytes else torch.empty(0, dtype=torch.uint8))
        else:
            data = torch.empty(int(header[1]), dtype=torch.uint8)
            if data.numel():
                group.recv([data], 0, 2).wait()
        try:
            got = int(self.import_fn(meta["tokens"], meta.get("salt"), data))
        except Exception:
            logger.exception("KV receiver: importing %d tokens failed", len(meta["tokens"]))
            got = -1
        if got < 0:
            self.stats.failed()
        else:
            self.stats.add(got, nbytes, time.perf_counter() - t0)
        group.send([torch.tensor([got, 0], dtype=torch.int64)], 0, 3).wait()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
