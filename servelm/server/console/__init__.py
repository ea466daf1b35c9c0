"""The web console: one page (chat, and the live dashboard over /v1/stats) served at `/`.

Plain JavaScript modules and one stylesheet, read from this package once when the app is
built; nothing is fetched from anywhere else. The page's Content-Security-Policy allows only
this server's own scripts, styles and connections: no inline script, no other origin.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from servelm.server.errors import APIError

# Served name -> media type; every asset of the page is listed here.
ASSETS = {"index.html": "text/html; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8",
          "markdown.js": "text/javascript; charset=utf-8",
          "roofline.js": "text/javascript; charset=utf-8",
          "console.css": "text/css; charset=utf-8"}

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def read_assets() -> dict[str, bytes]:
    """Every asset's bytes, from the installed package."""
    files = resources.files(__name__)
    return {name: (files / name).read_bytes() for name in ASSETS}


def router(api_key_required: bool) -> APIRouter:
    """GET / (the page) and GET /console/<asset>; open without an API key. The page is told
    whether /v1 needs one, so it asks for the key before its first request."""
    assets = read_assets()
    if api_key_required:
        assets["index.html"] = assets["index.html"].replace(
            b'<meta name="servelm-api-key" content="none">',
            b'<meta name="servelm-api-key" content="required">')
    r = APIRouter(include_in_schema=False)

    def serve(name: str) -> Response:
        return Response(assets[name], media_type=ASSETS[name], headers=_HEADERS)

    @r.get("/")
    async def page() -> Response:
        return serve("index.html")

    @r.get("/console/{name}")
    async def asset(name: str) -> Response:
        if name not in assets or name == "index.html":
            raise APIError(404, f"no console asset {name!r}", code="not_found")
        return serve(name)

    return r
