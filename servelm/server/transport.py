"""The connection layer under the app: the listening socket (quiet while out of file
descriptors), uvicorn's HTTP/1.1 protocol with header deadlines, and a server whose SIGTERM
drain ends with an answer for everyone."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one.

    Made with proto IPPROTO_TCP on purpose: asyncio sets TCP_NODELAY only on sockets whose
    proto says TCP, and without it a keep-alive connection pays Nagle's algorithm against
    the client's delayed ACK (~40 ms) on every response written in more than one piece.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = ListeningSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


# accept() failures that end when connections close: out of descriptors or kernel memory.
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ASYNCIO_ACCEPT_ERROR = "socket.accept() out of system resource"


class ListeningSocket(socket.socket):
    """A listening socket whose accept() fails quietly while the process is out of file
    descriptors: one log line a second at most, instead of a traceback a failed accept.

    asyncio, on such a failure, stops reading the socket for a second (then accepts again,
    so serving goes on once connections close), but it tries the rest of its accept batch
    first (uvicorn's backlog, 2048) and logs a traceback for each: 54 MB of log in 10 s at a
    256-descriptor limit. The first failure here is raised (asyncio then pauses); the calls
    after it within the pause report an empty queue instead, ending the batch.
    """

    _failed_at = -1e9
    _logged_at = -1e9

    def accept(self):
        now = time.monotonic()
        if now - self._failed_at < 0.5:  # asyncio's pause (1 s) has not passed since
            raise BlockingIOError(errno.EAGAIN, "accepting paused: out of resources")
        try:
            return super().accept()
        except OSError as e:
            if e.errno not in _OUT_OF_RESOURCES:
                raise
            self._failed_at = now
            if now - self._logged_at >= 1.0:
                self._logged_at = now
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                logger.error("cannot accept connections: %s (open-file limit %s); new "
                             "connections wait until some close (raise `ulimit -n`)",
                             e.strerror, soft)
            raise


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """An event-loop exception handler: asyncio's report of an accept() out of resources is
    dropped (ListeningSocket has logged its line); anything else goes to the default."""
    if context.get("message") == _ASYNCIO_ACCEPT_ERROR:
        return
    loop.default_exception_handler(context)


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one (each connection holds one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's headers.

    A connection gets header_timeout seconds from when it opens, or from the end of the
    previous response, to deliver a whole request head; a client that trickles bytes
    (slowloris) is closed then. uvicorn's own keep-alive timer only covers connections
    that send nothing at all.
    """

    header_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._cycle_at_deadline = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._cycle_at_deadline = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._cycle_at_deadline:
            self._disarm()  # a request's head has arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Unless super() already started a pipelined request (whose head is in).
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("closing %s: no complete request head within %.3g s",
                         self.client, self.header_timeout)
            self.transport.close()


def deadline_protocol(header_timeout: float) -> type[DeadlineH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this header deadline."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"header_timeout": header_timeout})


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown calls `on_start()` (refuse new requests), gives those
    in flight `drain_s` seconds, then calls `expire()` so each one ends with an error of its
    own (not a cut connection), then has `grace_s` more for those answers to reach their
    clients."""

    def __init__(self, config: uvicorn.Config, drain_s: float, expire: Callable[[], None],
                 on_start: Callable[[], None] = lambda: None, grace_s: float = 5.0):
        config.timeout_graceful_shutdown = drain_s + grace_s
        super().__init__(config)
        self.drain_s = drain_s
        self._expire = expire
        self._on_start = on_start

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(quiet_accept_errors)
        await super().serve(sockets)

    async def shutdown(self, sockets=None) -> None:
        self._on_start()
        timer = asyncio.get_running_loop().call_later(self.drain_s, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
