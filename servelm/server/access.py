"""What the API key guards besides the API: /metrics and the API's documentation.

With keys set, every /v1 route and vLLM's /tokenize and /detokenize need one (api.py);
these do too unless a flag opens them: /metrics (--public-metrics: a scraper that cannot
send a key) and /openapi.json, /docs, /redoc (--public-docs: the docs pages are read in a
browser, which cannot send a key). The console's page stays open: it asks for the key and
sends it on its own calls, which are all under /v1. /health stays open for load balancers
(it says only whether the server runs).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI, Request

from servelm.server.options import ServerOptions


def private_paths(app: FastAPI, options: ServerOptions) -> set[str]:
    """The paths outside the API that the key guards under these options."""
    if not options.api_keys:
        return set()
    paths = set() if options.public_metrics else {"/metrics"}
    if not options.public_docs:
        paths |= {p for p in (app.openapi_url, app.docs_url, app.redoc_url,
                              app.swagger_ui_oauth2_redirect_url) if p}
    return paths


def require_key(app: FastAPI, options: ServerOptions,
                check_api_key: Callable[[Request], Awaitable[None]]) -> set[str]:
    """Put private_paths' routes (FastAPI's own docs routes included) behind check_api_key;
    returns those paths. Call once every route is added."""
    paths = private_paths(app, options)
    for route in app.router.routes:
        if getattr(route, "path", None) in paths:
            route.app = _keyed(route.app, check_api_key)
    return paths


def _keyed(inner, check_api_key):
    """An ASGI route app that answers only requests with a key (APIError 401 otherwise,
    rendered by the app's handler)."""

    async def app(scope, receive, send) -> None:
        await check_api_key(Request(scope, receive))
        await inner(scope, receive, send)

    return app
