"""/openapi.json's error responses: each of servelm's routes lists the statuses it can answer
with, in OpenAI's error shape (ErrorResponse), and /metrics is declared as Prometheus text.

FastAPI infers only a route's 200; the statuses come from what guards a request (Host,
content type, size, the key: RequestGuard and access), what reads its body (408, 413) and
what the route does with it (the model check, the queue, a client gone). Routes of other
APIs (the adapters) keep the statuses they declare; those every request can meet at the
guard, in this shape whatever the route, are added to theirs.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from servelm.server.metrics import CONTENT_TYPE
from servelm.server.options import ServerOptions


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error servelm's own routes answer (OpenAI's shape)."""

    error: ErrorDetail


WHY = {
    400: "a malformed body, or a field that is missing, unknown or invalid (param names it); "
         "a LoRA adapter that cannot load (or LoRA not enabled)",
    401: "no API key, or a wrong one (Authorization: Bearer <key>, or x-api-key)",
    403: "the Host header does not name this server (--allowed-hosts)",
    404: "the model is neither the one this server serves nor a LoRA adapter loaded on it "
         "(unload: no adapter of that name)",
    408: "the body did not arrive within --body-timeout",
    413: "the body is over --max-request-bytes",
    415: "the body is not JSON (Content-Type: application/json)",
    499: "the client closed the connection before the answer (no body)",
    500: "an internal error",
    503: "the queue is full (Retry-After), the server is shutting down, or the engine has "
         "stopped",
}
# Met before any route runs (RequestGuard), so in this shape on every route.
GUARD = {"all": (403, 500), "post": (415,)}
# What each of servelm's own routes adds to the guard's and the key's (401: all of them
# where keys are set, but OPEN and the paths access leaves public).
ROUTES = {
    ("post", "/v1/chat/completions"): (400, 404, 408, 413, 499, 503),
    ("post", "/v1/completions"): (400, 404, 408, 413, 499, 503),
    ("post", "/tokenize"): (400, 404, 408, 413),
    ("post", "/detokenize"): (400, 404, 408, 413),
    ("get", "/v1/models"): (),
    ("get", "/v1/models/{name}"): (404,),
    ("get", "/v1/stats"): (),
    ("get", "/v1/cache_events"): (400, 503),
    ("post", "/v1/load_lora_adapter"): (400, 408, 413, 503),
    ("post", "/v1/unload_lora_adapter"): (400, 404, 408, 413, 503),
    ("get", "/health"): (503,),
    ("get", "/metrics"): (),
}
OPEN = {"/health", "/metrics"}


def document_errors(app: FastAPI, options: ServerOptions,
                    private: set[str] = frozenset()) -> None:
    """Add the error responses to app.openapi()'s schema; private: the paths of OPEN that
    are behind the key too (servelm.server.access). Call after the app's other openapi()
    changes."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                {"ErrorDetail": ErrorDetail.model_json_schema(),
                 "ErrorResponse": ErrorResponse.model_json_schema(
                     ref_template="#/components/schemas/{model}")})
            schema["components"]["schemas"]["ErrorResponse"].pop("$defs", None)
            for path, ops in schema.get("paths", {}).items():
                for method, op in ops.items():
                    own = (method, path) in ROUTES
                    codes = [*GUARD["all"], *GUARD.get(method, ()),
                             *ROUTES.get((method, path), ())]
                    if own and options.api_keys and (path not in OPEN or path in private):
                        codes.append(401)
                    _add(op, sorted(set(codes)))
            _declare_metrics(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _add(op: dict, codes: list[int]) -> None:
    responses = op.setdefault("responses", {})
    if _validation_cannot_fail(op):
        responses.pop("422", None)  # FastAPI's guess; servelm never answers it there
    for code in codes:
        if code == 499:
            responses.setdefault("499", {"description": WHY[499]})
            continue
        responses.setdefault(str(code), {
            "description": WHY[code],
            "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})


def _validation_cannot_fail(op: dict) -> bool:
    """Whether FastAPI's 422 is unreachable: only string path parameters, no body of its own
    (the hand-parsed bodies' errors are 400s)."""
    params = op.get("parameters", [])
    return all(p.get("in") == "path" and p.get("schema", {}).get("type") == "string"
               for p in params) and "422" in op.get("responses", {})


def _declare_metrics(schema: dict) -> None:
    op = schema.get("paths", {}).get("/metrics", {}).get("get")
    if op is not None:
        op["responses"]["200"] = {
            "description": "the metrics in Prometheus' text format",
            "content": {CONTENT_TYPE.partition(";")[0]: {"schema": {"type": "string"}}}}
