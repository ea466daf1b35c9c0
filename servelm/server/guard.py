"""What every HTTP request passes before a route sees it: a request id, the Host check, and
for bodies a JSON content type and a size limit; then the body read with a deadline."""

from __future__ import annotations

import asyncio
import re
import uuid

from fastapi import Request

from servelm.server.errors import APIError
from servelm.server.options import ServerOptions

REQUEST_ID_HEADER = b"x-request-id"
# A client's request id is echoed back when it is short printable ASCII.
_CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_JSON_TYPE = re.compile(r"^application/([\w.+-]+\+)?json$")


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class RequestGuard:
    """ASGI middleware: every response carries x-request-id (the client's, or a new one);
    a Host that does not name this server gets 403 (DNS rebinding); a body that is not
    JSON gets 415 (a cross-site form post); a declared body over the limit gets 413."""

    def __init__(self, app, options: ServerOptions):
        self.app = app
        self.options = options

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client_id = _header(scope, REQUEST_ID_HEADER)
        rid = client_id if client_id and _CLIENT_ID.match(client_id) else uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        error = self._check(scope)
        if error is not None:
            await error.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _check(self, scope) -> APIError | None:
        host = _header(scope, b"host")
        if not self.options.host_allowed(host):
            return APIError(403, f"the Host header {host!r} does not name this server; start it "
                                 f"with --allowed-hosts to accept that name",
                            code="host_not_allowed")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        ctype = (_header(scope, b"content-type") or "").partition(";")[0].strip().lower()
        if not _JSON_TYPE.match(ctype):
            return APIError(415, f"the request body must be JSON: send 'Content-Type: "
                                 f"application/json' (got {ctype or 'none'!r})",
                            code="unsupported_media_type")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.options.max_request_bytes:
            return _too_large(self.options)
        return None


def _too_large(options: ServerOptions) -> APIError:
    return APIError(413, f"the request body is over the server's limit of "
                         f"{options.max_request_bytes} bytes (--max-request-bytes)",
                    code="request_too_large")


async def read_body(request: Request, options: ServerOptions) -> bytes:
    """The whole body, refused (413) as soon as it passes the size limit and (408) if it takes
    longer than body_timeout to arrive."""
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > options.max_request_bytes:
                raise _too_large(options)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), options.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {options.body_timeout:g} s",
                       code="request_timeout") from None
    return b"".join(chunks)
