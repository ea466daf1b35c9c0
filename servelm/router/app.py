"""The router: an OpenAI-compatible front that passes each request to one of its backends
(servelm servers, or any OpenAI-compatible server) and streams the answer back as it comes.

A request's life here: the router's own key check; the body read (under a size limit); its
prompt tokenised as the backend will (prompts.py, in a worker thread, only where the
cache-aware policy has digests to compare); the policy's choice among the backends up
(policy.py); the request sent on a fresh connection, so that a connection refused means it
never reached the backend, and only then is it retried on another; the answer passed
through, a stream chunk by chunk (a backend dying mid-stream ends it with an error event),
a plain answer whole (a backend dying before it answers: 502).

Each backend has a monitor task: its health (GET /health, else /v1/models for a server
without one) every health_interval, its load (GET /v1/stats: running and waiting tokens)
twice as often, and while it is up its prefix cache's events (GET /v1/cache_events) every
poll_interval; a backend that fails a check, or refuses a
connection, leaves the rotation until a check passes again."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from servelm.router.policy import REASONS, BackendView, Policy
from servelm.router.prompts import CHAT, COMPLETIONS, MESSAGES, Prompt, PromptReader
from servelm.server.errors import APIError

logger = logging.getLogger(__name__)

# Headers that belong to one connection, never forwarded.
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
        "upgrade", "proxy-authorization", "proxy-connection", "trailer"}
_TOKENISED = (CHAT, COMPLETIONS, MESSAGES)
_STREAMED = ("text/event-stream", "application/x-ndjson")
# Disaggregation: the routes whose prompts may be prefilled on a prefill backend (their
# bodies take kv_transfer_params), and what became of each request's prompt.
_PREFILLED = (CHAT, COMPLETIONS)
REMOTE, LOCAL, FAILED = "remote", "local", "failed"
PREFILL_OUTCOMES = (REMOTE, LOCAL, FAILED)
PREFILL_FLOOR = 64  # tokens: the least a prompt prefilled elsewhere has uncached


@dataclass(frozen=True)
class RouterConfig:
    """The router's options (validated here: ValueError names the bad one).

    load_bound: tokens by which the backend holding the longest cached prefix may be more
    loaded than the least loaded one and still get the request (cache_aware).
    model: where the backends' tokenizer is read from (a .gguf file or a model directory);
    None: the first backend's /v1/models root (a path on the backend's host).
    backend_api_key: sent to every backend instead of the client's own key (default: the
    client's goes through). poll_api_key: the key of the router's own checks and polls
    (default backend_api_key). forward_host: send the client's Host header on (the
    data-parallel front, whose replicas check it as the front would: --allowed-hosts);
    otherwise each backend gets its own URL's. backends_check_keys: the backends hold the
    same api_keys and check them (the data-parallel front): proxied requests are left to
    them (the console, CORS preflights and public docs as each server has them), and
    api_keys guard only the router's own /v1/stats and /metrics (/metrics open with
    public_metrics)."""

    backends: tuple[str, ...]
    prefill_backends: tuple[str, ...] = ()
    prefill_min_tokens: int | None = None
    policy: str = "cache_aware"
    load_bound: int = 4096
    model: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    api_keys: tuple[str, ...] = ()
    backend_api_key: str | None = None
    poll_api_key: str | None = None
    forward_host: bool = False
    backends_check_keys: bool = False
    public_metrics: bool = False
    poll_interval: float = 0.1
    health_interval: float = 1.0
    connect_timeout: float = 2.0
    prefill_timeout: float = 300.0
    max_request_bytes: int = 8 << 20

    def __post_init__(self):
        if not self.backends:
            raise ValueError("the router needs at least one backend: --backend URL [URL ...]")
        for url in self.backends:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"a backend is an http(s) URL like http://10.0.0.2:8000, "
                                 f"got {url!r}")
        for url in self.prefill_backends:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"a prefill backend is an http(s) URL like "
                                 f"http://10.0.0.3:8000, got {url!r}")
        named = [u.rstrip("/") for u in (*self.backends, *self.prefill_backends)]
        if len(set(named)) != len(named):
            raise ValueError("a backend is named twice")
        if self.prefill_min_tokens is not None and self.prefill_min_tokens < 1:
            raise ValueError(f"prefill_min_tokens must be >= 1, got {self.prefill_min_tokens}")
        Policy(self.policy, self.load_bound)  # its ValueError names the policy
        for name in ("poll_interval", "health_interval", "connect_timeout", "prefill_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Backend:
    """A backend: its URL, the policy's view of it, and the router's counters for it."""

    url: str
    view: BackendView
    routed: int = 0
    failures: int = 0
    last_error: str | None = None
    last_health: float = 0.0
    last_stats: float = 0.0
    model_id: str | None = None
    model_root: str | None = None
    model_read: bool = False
    kv_host: str | None = None      # its KV receiver (a decode server's), from /v1/stats
    kv_port: int | None = None
    ridge_tokens: float | None = None  # its roofline's ridge, in tokens a step


class Router:
    """The backends, their monitors, the policy and the counters; serves through app()."""

    def __init__(self, config: RouterConfig, tokenizer=None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.policy = Policy(config.policy, config.load_bound)
        self.backends = [Backend(u.rstrip("/"), BackendView(u.rstrip("/"), up=False))
                         for u in config.backends]
        # Disaggregated serving: prompts prefilled here, their KV sent to the backend above
        # that answers (servelm.server.disaggregation).
        self.prefills = [Backend(u.rstrip("/"), BackendView(u.rstrip("/"), up=False))
                         for u in config.prefill_backends]
        self.prefill_policy = Policy(config.policy, config.load_bound)
        self.prefilled = dict.fromkeys(PREFILL_OUTCOMES, 0)
        self.reader = PromptReader(tokenizer) if tokenizer is not None else None
        self.routed = dict.fromkeys(REASONS, 0)
        self.retries = 0
        self.failed_midway = 0
        self.unavailable = 0
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """The client, one first check of every backend (so a request right after start
        finds those up), then their monitors."""
        c = self.config
        # No keep-alive: every request opens its own connection, so that a refused one
        # surely never reached the backend (a reused connection's failure could be either).
        self._client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(connect=c.connect_timeout, read=None, write=60.0,
                                  pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        await asyncio.gather(*(self._check(b) for b in self.all_backends))
        self._tasks = [asyncio.create_task(self._monitor(b)) for b in self.all_backends]
        if self.reader is None and self.config.policy == "cache_aware":
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    @property
    def all_backends(self) -> list[Backend]:
        """The backends that answer, then the prefill ones."""
        return self.backends + self.prefills

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()

    async def _load_tokenizer(self) -> None:
        """The backends' tokenizer, from --model or the first backend's /v1/models root
        (until it is loaded, requests are routed by load)."""
        from servelm.tokenizer import load_tokenizer

        path = self.config.model
        while path is None:
            path = next((b.model_root for b in self.backends if b.model_root), None)
            if path is None:
                await asyncio.sleep(self.config.health_interval)
        try:
            tok = await asyncio.to_thread(load_tokenizer, path)
        except Exception as e:  # the backends' root is a path on their host, maybe not here
            logger.warning("router: cannot load the backends' tokenizer from %s (%s): routing "
                           "by load only (give --model)", path, e)
            return
        if self.config.chat_template is not None:
            tok.chat_template = self.config.chat_template
        tok.default_template_kwargs = dict(self.config.chat_template_kwargs or {})
        name = next((b.model_id for b in self.backends if b.model_id), None)
        self.reader = PromptReader(tok, name)

    def _headers(self) -> dict[str, str]:
        key = self.config.poll_api_key or self.config.backend_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _check(self, b: Backend) -> None:
        """One health check: GET /health (a server without it: /v1/models)."""
        b.last_health = time.monotonic()
        try:
            r = await self._client.get(f"{b.url}/health", headers=self._headers(),
                                       timeout=self.config.connect_timeout + 1)
            if r.status_code == 404:
                r = await self._client.get(f"{b.url}/v1/models", headers=self._headers(),
                                           timeout=self.config.connect_timeout + 1)
            ok = r.status_code == 200
            why = None if ok else f"health check answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"health check failed: {e!r}"
        if ok and not b.model_read:
            await self._read_model(b)
        self._set_up(b, ok, why)

    async def _read_model(self, b: Backend) -> None:
        try:
            r = await self._client.get(f"{b.url}/v1/models", headers=self._headers(),
                                       timeout=self.config.connect_timeout + 1)
            card = r.json()["data"][0]
            b.model_id, b.model_root = card.get("id"), card.get("root")
            b.model_read = True
        except Exception:
            pass

    def _set_up(self, b: Backend, up: bool, why: str | None = None) -> None:
        if up and not b.view.up:  # a first check passing is no news
            (logger.warning if b.failures or b.last_error else logger.info)(
                "router: backend %s is up", b.url)
        elif not up and (b.view.up or b.last_error is None):
            logger.warning("router: backend %s %s: %s", b.url,
                           "left the rotation" if b.view.up else "is not answering", why)
        if not up and b.view.up:
            b.view.forget_cache()
            b.view.reported_tokens = 0
            b.view.servelm = None  # asked again when it comes back
        b.view.up = up
        if why:
            b.last_error = why

    async def _poll_events(self, b: Backend) -> None:
        v = b.view
        params = {} if v.seq is None else {"since": v.seq, "instance": v.instance}
        try:
            r = await self._client.get(f"{b.url}/v1/cache_events", params=params,
                                       headers=self._headers(),
                                       timeout=self.config.connect_timeout + 1)
        except httpx.HTTPError as e:
            self._set_up(b, False, f"cache events failed: {e!r}")
            return
        if r.status_code == 200:
            v.apply_events(r.json())
        elif r.status_code in (404, 405):
            v.servelm = False  # not servelm (or an older one): load-balanced only
        elif r.status_code in (401, 403):
            logger.warning("router: backend %s refuses its cache events (%d): give "
                           "--backend-api-key; load-balanced only", b.url, r.status_code)
            v.servelm = False

    async def _poll_stats(self, b: Backend) -> None:
        """The backend's running + waiting tokens (a servelm's /v1/stats)."""
        b.last_stats = time.monotonic()
        try:
            r = await self._client.get(f"{b.url}/v1/stats", headers=self._headers(),
                                       timeout=self.config.connect_timeout + 1)
            report = r.json() if r.status_code == 200 else {}
            req = report.get("requests", {})
        except (httpx.HTTPError, ValueError, AttributeError):
            return  # the health check and the events tell a dead backend
        receiver = (report.get("kv_transfer") or {}).get("receiver")
        if isinstance(receiver, dict) and isinstance(receiver.get("port"), int):
            b.kv_host, b.kv_port = _kv_host(receiver.get("host"), b.url), receiver["port"]
        else:
            b.kv_host = b.kv_port = None
        ridge = (report.get("roofline") or {}).get("ridge_tokens")
        b.ridge_tokens = ridge if isinstance(ridge, (int, float)) else None
        tokens = [req.get("running_tokens"), req.get("waiting_tokens")]
        if all(isinstance(t, int) for t in tokens):
            b.view.reported_tokens = sum(tokens)

    async def _monitor(self, b: Backend) -> None:
        c = self.config
        while True:
            try:
                now = time.monotonic()
                if not b.view.up or now - b.last_health >= c.health_interval:
                    await self._check(b)
                if (b.view.up and c.policy != "round_robin" and b.view.servelm is not False
                        and now - b.last_stats >= c.health_interval / 2):
                    await self._poll_stats(b)
                if b.view.up and b.view.servelm is not False and c.policy == "cache_aware":
                    await self._poll_events(b)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("router: monitoring %s", b.url)
            await asyncio.sleep(c.poll_interval if b.view.up else
                                min(c.health_interval, 0.5))

    # ---- routing -----------------------------------------------------------------------

    def _client_key(self, request: Request) -> str | None:
        return _bearer(request.headers)

    def check_key(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        sent = (self._client_key(request) or "").encode()
        match = False
        for key in self.config.api_keys:
            match |= hmac.compare_digest(sent, key.encode())
        if not match:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", code="invalid_api_key")

    async def _prompt(self, path: str, body: bytes) -> Prompt:
        """The request's prompt where the cache-aware policy can use it (tokenised in a
        worker thread), else only its expected output (for the load)."""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            return Prompt()
        reader = self.reader
        wanted = (path in _TOKENISED and reader is not None and (
            (self.config.policy == "cache_aware" and any(b.view.cached for b in self.backends))
            or (self.prefills and path in _PREFILLED)))
        if not wanted:
            mt = parsed.get("max_tokens") if isinstance(parsed, dict) else None
            return Prompt(max_tokens=mt if isinstance(mt, int) else None)
        return await asyncio.to_thread(reader.read, path, parsed)

    def _choose(self, prompt: Prompt, api_key: str | None, tried: list[BackendView]):
        key = self.config.backend_api_key or api_key

        def digests_for(block_size: int, keyed: bool) -> list[int]:
            return prompt.digests(block_size, key if keyed else None)

        return self.policy.choose([b.view for b in self.backends], digests_for, tried)

    def _forward_headers(self, request: Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if self.config.forward_host and "host" in request.headers:
            out["host"] = request.headers["host"]
        if self.config.backend_api_key:
            out.pop("x-api-key", None)
            out["authorization"] = f"Bearer {self.config.backend_api_key}"
        return out

    async def proxy(self, request: Request) -> Response:
        """Pass a request to the backend the policy picks; the answer back as it comes."""
        if not self.config.backends_check_keys:
            self.check_key(request)
        body = await self._read_body(request)
        path = request.url.path
        prompt = await self._prompt(path, body) if request.method == "POST" else Prompt()
        load = prompt.load_tokens() if prompt.token_ids is not None else (
            len(body) // 4 + (prompt.max_tokens or 256) if request.method == "POST" else 0)
        headers = self._forward_headers(request)
        tried: list[BackendView] = []
        errors: list[str] = []
        while True:
            choice = self._choose(prompt, self._client_key(request), tried)
            if choice is None:
                self.unavailable += 1
                detail = f" ({'; '.join(errors)})" if errors else ""
                raise APIError(503, f"no backend is available: none of the "
                                    f"{len(self.backends)} is up{detail}",
                               code="no_backend_available", headers={"Retry-After": "1"})
            b = next(x for x in self.backends if x.view is choice.backend)
            if not tried and self.prefills and path in _PREFILLED:
                await self._prefill(b, choice, prompt, body, path, headers)
            tried.append(b.view)
            url = f"{b.url}{path}" + (f"?{request.url.query}" if request.url.query else "")
            upstream = self._client.build_request(request.method, url, content=body,
                                                  headers=headers)
            b.view.load_tokens += load
            b.view.inflight += 1
            try:
                resp = await self._client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # Never reached it: out of the rotation, and the request goes elsewhere.
                self._release(b, load)
                b.failures += 1
                self._set_up(b, False, f"connection failed: {e!r}")
                errors.append(f"{b.url}: {type(e).__name__}")
                self.retries += 1
                continue
            except httpx.HTTPError as e:
                self._release(b, load)
                b.failures += 1
                self._set_up(b, False, f"failed before answering: {e!r}")
                raise APIError(502, f"backend {b.url} failed before answering: {e!r}",
                               code="backend_failed", type="server_error") from None
            except BaseException:
                self._release(b, load)
                raise
            self.routed[choice.reason] += 1
            b.routed += 1
            return await self._answer(request, b, resp, load, path)

    def prefill_threshold(self, decode: Backend) -> int:
        """Prompt tokens the decode backend has not cached at which a prompt is prefilled
        on a prefill backend: --prefill-min-tokens, else the decode backend's roofline
        ridge (a chunk past it makes the step it shares with the decodes compute-bound),
        at least PREFILL_FLOOR (below it the transfer's fixed costs outweigh the stall)."""
        if self.config.prefill_min_tokens is not None:
            return self.config.prefill_min_tokens
        return max(PREFILL_FLOOR, math.ceil(decode.ridge_tokens or 0))

    async def _prefill(self, decode: Backend, choice, prompt: Prompt, body: bytes, path: str,
                       headers: dict[str, str]) -> None:
        """A long prompt's prefill on a prefill backend, its KV sent to `decode` (which
        then finds it in its prefix cache). Any failure only means the decode backend
        computes the prompt itself: the request is never lost to it."""
        if prompt.token_ids is None or decode.kv_port is None or not prompt.cacheable:
            self.prefilled[LOCAL] += 1
            return
        block = decode.view.block_size or 16
        uncached = prompt.num_tokens - choice.cached_blocks * block
        if uncached < self.prefill_threshold(decode):
            self.prefilled[LOCAL] += 1
            return
        key = self.config.backend_api_key or _bearer(headers)

        def digests_for(block_size: int, keyed: bool) -> list[int]:
            return prompt.digests(block_size, key if keyed else None)

        pick = self.prefill_policy.choose([p.view for p in self.prefills], digests_for)
        if pick is None:
            self.prefilled[LOCAL] += 1
            return
        p = next(x for x in self.prefills if x.view is pick.backend)
        try:
            parsed = json.loads(body)
            payload = prefill_body(parsed, decode.kv_host, decode.kv_port)
        except (ValueError, TypeError):
            self.prefilled[LOCAL] += 1
            return
        load = prompt.num_tokens + 1
        p.view.load_tokens += load
        p.view.inflight += 1
        call = asyncio.ensure_future(self._client.post(
            f"{p.url}{path}", content=payload, headers=headers,
            timeout=httpx.Timeout(self.config.prefill_timeout,
                                  connect=self.config.connect_timeout)))
        try:
            # A prefill backend that stops answering leaves the rotation at its next failed
            # health check: its prompt then goes to the decode backend, not waiting on.
            while not (await asyncio.wait({call}, timeout=self.config.health_interval / 2))[0]:
                if not p.view.up:
                    call.cancel()
                    break
            r = await call
            sent = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            why = (f"answered {r.status_code}" if r.status_code != 200 else
                   "sent no KV" if not isinstance(sent, dict) else sent.get("error"))
        except asyncio.CancelledError:
            if not call.cancelled():  # the client's request itself was cancelled
                call.cancel()
                raise
            why = "it left the rotation while prefilling"
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            why = repr(e)
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                self._set_up(p, False, f"connection failed: {e!r}")
        finally:
            self._release(p, load)
        p.routed += 1
        if why:
            logger.warning("router: prefill on %s failed (%s): %s computes the prompt",
                           p.url, why, decode.url)
            self.prefilled[FAILED] += 1
        else:
            self.prefilled[REMOTE] += 1

    def _release(self, b: Backend, load: int) -> None:
        b.view.load_tokens -= load
        b.view.inflight -= 1

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over {limit} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _answer(self, request: Request, b: Backend, resp: httpx.Response, load: int,
                      path: str) -> Response:
        out_headers = {k: v for k, v in resp.headers.items()
                       if k.lower() not in _HOP and k.lower() != "content-encoding"}
        kind = resp.headers.get("content-type", "")
        if kind.startswith(_STREAMED):
            done = False

            async def cleanup():  # once, whether the stream ran, ended or never started
                nonlocal done
                if not done:
                    done = True
                    await resp.aclose()
                    self._release(b, load)

            return _RelayResponse(self._relay(b, resp, path, kind, cleanup), cleanup,
                                  status_code=resp.status_code, headers=out_headers)
        try:
            reading = asyncio.ensure_future(resp.aread())
            gone = asyncio.ensure_future(_wait_disconnect(request))
            await asyncio.wait({reading, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not reading.done():  # the client left: dropping the connection aborts it
                reading.cancel()
                await asyncio.wait({reading})
                return Response(status_code=499)
            data = reading.result()
        except httpx.HTTPError as e:
            b.failures += 1
            self.failed_midway += 1
            self._set_up(b, False, f"failed mid-answer: {e!r}")
            raise APIError(502, f"backend {b.url} failed before finishing its answer: {e!r}",
                           code="backend_failed", type="server_error") from None
        finally:
            await resp.aclose()
            self._release(b, load)
        return Response(data, status_code=resp.status_code, headers=out_headers)

    async def _relay(self, b: Backend, resp: httpx.Response, path: str, kind: str, cleanup):
        """A streamed answer, chunk by chunk; a backend failing midway ends it with an error
        event (and the OpenAI stream's [DONE])."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            b.failures += 1
            self.failed_midway += 1
            self._set_up(b, False, f"failed mid-stream: {e!r}")
            yield _stream_error(path, kind, f"backend {b.url} failed mid-stream: {e!r}")
        finally:
            await cleanup()

    # ---- aggregate views ---------------------------------------------------------------

    async def _gather(self, path: str) -> list[httpx.Response | None]:
        async def one(b: Backend):
            if not b.view.up:
                return None
            try:
                return await self._client.get(f"{b.url}{path}", headers=self._headers(),
                                              timeout=self.config.connect_timeout + 3)
            except httpx.HTTPError:
                return None

        return await asyncio.gather(*(one(b) for b in self.all_backends))

    def router_stats(self) -> dict:
        return {"policy": self.config.policy, "load_bound": self.config.load_bound,
                "routed": dict(self.routed), "retries": self.retries,
                "failed_midway": self.failed_midway, "unavailable": self.unavailable,
                "backends_up": sum(b.view.up for b in self.backends),
                "backends_total": len(self.backends),
                "prefill_backends_up": sum(b.view.up for b in self.prefills),
                "prefilled": dict(self.prefilled),
                "tokenizer": self.reader is not None}

    def _backend_entry(self, b: Backend) -> dict:
        v = b.view
        role = None  # a plain router's backends have none
        if self.prefills:
            role = "prefill" if any(b is p for p in self.prefills) else "decode"
        return {"url": b.url, "role": role,
                "up": v.up, "servelm": v.servelm, "routed": b.routed,
                "failures": b.failures, "last_error": b.last_error,
                "inflight_requests": v.inflight, "load_tokens": v.load_tokens,
                "reported_tokens": v.reported_tokens,
                "cached_blocks": len(v.cached), "block_size": v.block_size,
                "kv_receiver": None if b.kv_port is None else f"{b.kv_host}:{b.kv_port}"}

    async def stats(self) -> dict:
        """GET /v1/stats: a servelm report (the web console reads it) whose counts are the
        backends' summed (the rest: the first answering backend's), each backend's own
        report, and the router's counters."""
        answers = await self._gather("/v1/stats")
        reports = []
        for b, r in zip(self.all_backends, answers):
            entry = self._backend_entry(b)
            try:
                entry["stats"] = r.json() if r is not None and r.status_code == 200 else None
            except ValueError:
                entry["stats"] = None
            reports.append(entry)
        found = [e["stats"] for e in reports if isinstance(e["stats"], dict)]
        base = json.loads(json.dumps(found[0])) if found else {}
        for section, values in _sum_stats(found).items():
            base.setdefault(section, {})
            if isinstance(base[section], dict):
                base[section].update(values)
        return {**base, "object": "servelm.router.stats", "router": self.router_stats(),
                "backends": reports}

    async def metrics(self) -> str:
        """GET /metrics: every backend's families with a backend label, then the router's."""
        answers = await self._gather("/metrics")
        texts = [(b.url, r.text) for b, r in zip(self.all_backends, answers)
                 if r is not None and r.status_code == 200]
        return merge_metrics(texts) + self._router_metrics()

    def _router_metrics(self) -> str:
        lines = ["# HELP servelm_router_routed_total Requests routed, by why the backend "
                 "was chosen", "# TYPE servelm_router_routed_total counter"]
        lines += [f'servelm_router_routed_total{{reason="{r}"}} {n}'
                  for r, n in self.routed.items()]
        for name, help_, value in (
                ("retries_total", "Requests retried on another backend (never reached one)",
                 self.retries),
                ("failed_midway_total", "Answers a backend failed partway", self.failed_midway),
                ("unavailable_total", "Requests refused because no backend was up",
                 self.unavailable)):
            lines += [f"# HELP servelm_router_{name} {help_}",
                      f"# TYPE servelm_router_{name} counter", f"servelm_router_{name} {value}"]
        lines += ["# HELP servelm_router_backends_up Backends in the rotation",
                  "# TYPE servelm_router_backends_up gauge",
                  f"servelm_router_backends_up {sum(b.view.up for b in self.backends)}"]
        for name, help_, get in (
                ("backend_up", "Whether the backend is in the rotation", lambda b: int(b.view.up)),
                ("backend_load_tokens", "Its load: the more of the tokens of the "
                 "router's requests in flight there and the running + waiting tokens it "
                 "reported", lambda b: b.view.load),
                ("backend_cached_blocks", "Prefix-cache blocks it holds (its events)",
                 lambda b: len(b.view.cached)),
                ("backend_routed_total", "Requests routed to it", lambda b: b.routed)):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP servelm_router_{name} {help_}",
                      f"# TYPE servelm_router_{name} {kind}"]
            lines += [f'servelm_router_{name}{{backend="{_label(b.url)}"}} {get(b)}'
                      for b in self.all_backends]
        lines += ["# HELP servelm_router_prefilled_total Requests by where their prompt ran: "
                  "remote (a prefill backend, its KV sent), local (the answering backend), "
                  "failed (a prefill backend failed: the answering backend computed it)",
                  "# TYPE servelm_router_prefilled_total counter"]
        lines += [f'servelm_router_prefilled_total{{outcome="{k}"}} {n}'
                  for k, n in self.prefilled.items()]
        return "\n".join(lines) + "\n"

    # ---- the app -----------------------------------------------------------------------

    def app(self) -> FastAPI:
        router = self

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            await router.start()
            try:
                yield
            finally:
                await router.stop()

        app = FastAPI(title="servelm router", lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return exc.response()

        @app.get("/health")
        async def health():
            up = sum(b.view.up for b in router.backends)
            if not up:
                raise APIError(503, "no backend is up", code="no_backend_available")
            return {"status": "ok", "backends_up": up, "backends": len(router.backends)}

        @app.get("/v1/stats")
        async def stats(request: Request):
            router.check_key(request)
            return await router.stats()

        @app.get("/metrics")
        async def metrics(request: Request):
            if not router.config.public_metrics:
                router.check_key(request)
            return Response(await router.metrics(),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.api_route("/{path:path}",
                       methods=["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"])
        async def proxy(request: Request, path: str):
            return await router.proxy(request)

        return app


class _RelayResponse(StreamingResponse):
    """A relayed stream whose upstream answer is closed, and its load released, however the
    response ends (a client gone before the stream started never runs the generator)."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stream_error(path: str, kind: str, message: str) -> bytes:
    """The event that ends a stream its backend failed: the API's own error shape."""
    if kind.startswith("application/x-ndjson"):  # Ollama's streams
        return (json.dumps({"error": message}) + "\n").encode()
    if path.startswith("/v1/messages"):  # Anthropic's
        from servelm.server.anthropic import AnthropicError

        err = AnthropicError(502, message).body()
        return f"event: error\ndata: {json.dumps(err)}\n\n".encode()
    err = APIError(502, message, code="backend_failed", type="server_error").body()
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def _bearer(headers) -> str | None:
    """The API key a request's headers carry (Authorization: Bearer, or x-api-key)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if not token and headers.get("x-api-key"):
        return headers["x-api-key"].strip()
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def prefill_body(body: dict, host: str, port: int) -> bytes:
    """A chat or completions body as a prefill backend gets it: one greedy-or-not token, not
    streamed, one sample, and its prompt's KV sent to host:port (kv_transfer_params)."""
    if not isinstance(body, dict):
        raise TypeError("a request body is a JSON object")
    out = {k: v for k, v in body.items()
           if k not in ("max_completion_tokens", "stream_options", "min_tokens",
                        "prompt_logprobs", "n", "best_of")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "remote_host": host, "remote_port": port})
    return json.dumps(out).encode()


def _kv_host(advertised: str | None, url: str) -> str:
    """Where a backend's KV receiver is reached: the address it advertises, unless that is
    a wildcard or loopback one (then its URL's host, as this router reaches it)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if not advertised or advertised in ("0.0.0.0", "::", ""):
        return host
    if advertised.startswith("127.") or advertised in ("::1", "localhost"):
        return host if host.startswith("127.") or host in ("::1", "localhost") else advertised
    return advertised


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of several backends as one: each family once (its HELP and TYPE),
    its samples from every backend with a backend label added."""
    families: dict[str, dict] = {}
    for url, text in texts:
        label = f'backend="{_label(url)}"'
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = families.setdefault(parts[2], {"meta": {}, "samples": []})
                    family["meta"].setdefault(parts[1], line)
                continue
            m = _NAME.match(line)
            if m is None:
                continue
            name, rest = m.group(0), line[m.end():]
            if rest.startswith("{"):
                inner = rest[1:]
                sample = f"{name}{{{label}{',' if not inner.startswith('}') else ''}{inner}"
            else:
                sample = f"{name}{{{label}}}{rest}"
            target = family if family is not None else families.setdefault(
                name, {"meta": {}, "samples": []})
            target["samples"].append(sample)
    out = []
    for fam in families.values():
        out += [fam["meta"][k] for k in ("HELP", "TYPE") if k in fam["meta"]]
        out += fam["samples"]
    return "\n".join(out) + ("\n" if out else "")


def _sum_stats(reports: list[dict]) -> dict:
    """The parts of several /v1/stats reports that add up: requests, KV blocks, prefix
    cache and token counts and rates."""
    def total(*keys) -> float | None:
        values = []
        for r in reports:
            v = r
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            if isinstance(v, (int, float)):
                values.append(v)
        return sum(values) if values else None

    queried = total("prefix_cache", "queried_tokens") or 0
    hits = total("prefix_cache", "hit_tokens") or 0
    used, blocks = total("kv_cache", "blocks_used"), total("kv_cache", "blocks_total")
    capacity = total("kv_cache", "capacity_tokens")
    return {
        "requests": {k: total("requests", k)
                     for k in ("running", "waiting", "preemptions", "aborted")},
        "kv_cache": {"blocks_used": used, "blocks_total": blocks, "capacity_tokens": capacity,
                     "usage": used / blocks if used is not None and blocks else None},
        "prefix_cache": {"queried_tokens": queried, "hit_tokens": hits,
                         "hit_rate": hits / queried if queried else None},
        "tokens": {k: total("tokens", k) for k in ("prompt", "generated", "prompt_per_s",
                                                    "generated_per_s")},
    }
