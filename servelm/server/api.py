"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, SSE with disconnect detection.

A request's life here: RequestGuard (request id, Host, content type, declared size), the key
check, the body read under a size limit and a deadline, then parsing, the chat template and
tokenising in a worker thread, and only then the engine, from the event loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm.engine.async_engine import AsyncLLMEngine
from servelm.server import chat, completions, console, reasoning, tokenize
from servelm.server.errors import APIError, from_validation_error
from servelm.server.guard import RequestGuard, read_body
from servelm.server.metrics import CONTENT_TYPE, ServerMetrics
from servelm.server.options import ServerOptions
from servelm.server.protocol import (ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, CompletionChunk, CompletionRequest,
                                     CompletionResponse, ModelCard, ModelList)
from servelm.server.serving import Generation, ServingContext
from servelm.server.sse import EventStreamResponse
from servelm.server import stats as stats_mod
from servelm.server.stats import LiveStats
from servelm.server.tools import parser_for_template
from servelm.server import access, openapi_errors
from servelm.server import anthropic, embeddings, loras, ollama, responses  # adapters

# Protocol adapters: modules whose add_routes(app, routes) serve another API (Anthropic's,
# OpenAI's Responses, Ollama's, vLLM's LoRA loading ...) over the same generation path.
ADAPTERS: tuple = (embeddings, ollama, responses, anthropic, loras)

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _parse(body: bytes, model: type[M]) -> M:
    # Parsed by hand (not as a FastAPI body parameter) so that every failure maps to one
    # OpenAI-shaped 400, and so that it can run off the event loop.
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _cache_salt(key_salt: str | None, request_salt: str | None,
                cache_prompt: bool = True) -> str | None:
    """One prefix-cache namespace per (API key, cache_salt); None: the shared one.
    cache_prompt false (llama-server's): a namespace of the request's own, so it reads no
    cached prefix and leaves none that another request could find."""
    if not cache_prompt:
        return f"{key_salt or ''}/{request_salt or ''}/{uuid.uuid4().hex}"
    if key_salt is None and request_salt is None:
        return None
    return f"{key_salt or ''}/{request_salt or ''}"


def _ref(m: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{m.__name__}"}


def _openapi_request(request: type[BaseModel]) -> dict:
    """A hand-parsed route's body, for /openapi.json."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(request)}}}}


def _openapi_body(request: type[BaseModel], response: type[BaseModel],
                  chunk: type[BaseModel]) -> dict:
    """What a hand-parsed route takes and gives, for /openapi.json."""
    ref = _ref
    return {"openapi_extra": _openapi_request(request),
            "responses": {200: {"description": "the answer, or with stream=true server-sent "
                                               "events of chunks, ending with data: [DONE]",
                                "content": {"application/json": {"schema": ref(response)},
                                            "text/event-stream": {"schema": ref(chunk)}}}}}


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work, gen: Generation):
    """Await a non-streaming response, aborting its requests if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            gen.close()
    if not task.done():
        await asyncio.wait({task})  # let the cancellation land (result() would raise)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening for it
    return task.result()


@dataclass
class Routes:
    """What a protocol adapter (servelm.server.ADAPTERS: another API over the same
    generation path) needs from the app to add its routes: the serving context, the
    options, the API-key check (a FastAPI dependency), the model check (the LoRA adapter
    the name runs, None for the base; a 404 in OpenAI's shape when it names neither), the
    body reader (size and time limits), and the disconnect watch of non-streaming answers."""

    ctx: ServingContext
    options: ServerOptions
    check_api_key: Callable
    check_model: Callable[[str], str | None]

    async def read(self, request: Request) -> bytes:
        return await read_body(request, self.options)

    @staticmethod
    async def unless_disconnected(request: Request, work, gen: Generation):
        return await _unless_disconnected(request, work, gen)

    @staticmethod
    def cache_salt(request: Request, request_salt: str | None = None,
                   cache_prompt: bool = True) -> str | None:
        return _cache_salt(request.state.key_salt, request_salt, cache_prompt)


def build_app(engine: AsyncLLMEngine, model_name: str, options: ServerOptions | None = None,
              tool_call_parser: str = "auto", reasoning_parser: str = "auto",
              disaggregation=None) -> FastAPI:
    """An app serving `engine` as `model_name`; the engine thread runs for the app's lifespan.

    With options.api_keys set, every /v1 route needs `Authorization: Bearer <one of them>`.
    tool_call_parser: how answers to requests with tools are read (servelm.server.tools).
    reasoning_parser: how a thought is told from the answer (servelm.server.reasoning).
    disaggregation: the server's KV sender and receiver (servelm.server.disaggregation;
    None: requests asking for a KV transfer are refused).
    """
    options = options or ServerOptions()
    metrics = ServerMetrics(engine)
    ctx = ServingContext(engine, metrics, model_name,
                         parser_for_template(tool_call_parser, engine.tokenizer.chat_template),
                         reasoning.parser_for_template(reasoning_parser,
                                                       engine.tokenizer.chat_template))
    live = LiveStats(engine, metrics, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.tokenizer.max_token_chars  # computed now, not under the first big request
        engine.start()
        try:
            yield
        finally:
            if disaggregation is not None:
                disaggregation.stop()
            engine.stop()

    app = FastAPI(title="servelm", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(RequestGuard, options=options)
    if options.allowed_origins:  # outermost: preflights are answered before any check
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=options.cors_methods, allow_headers=options.cors_headers,
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)

    async def check_api_key(request: Request) -> None:
        """Sets request.state.key_salt: the prefix-cache namespace of the key it sent."""
        request.state.key_salt = None
        if not options.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not token and request.headers.get("x-api-key"):  # Anthropic's clients send this
            scheme, token = "bearer", request.headers["x-api-key"]
        sent = token.strip().encode()
        # Every key compared, in constant time each: which one matched does not show.
        match = None
        for key in options.api_keys:
            if hmac.compare_digest(sent, key.encode()):
                match = key
        if scheme.lower() != "bearer" or match is None:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')",
                           code="invalid_api_key")
        request.state.key_salt = options.key_salt(match)

    def check_model(name: str) -> str | None:
        """The LoRA adapter `name` runs (None: the served model); 404 when it is neither."""
        try:
            return ctx.adapter(name)
        except KeyError:
            adapters = ", ".join(f"'{a}'" for a in engine.loras)
            also = f" and the LoRA adapters {adapters}" if adapters else ""
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{model_name}'{also}", param="model",
                           code="model_not_found") from None

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card() -> ModelCard:
        llm = getattr(engine, "engine", None)  # None until the engine thread has built it
        cfg = getattr(llm, "model_config", None)
        return ModelCard(id=model_name, family=cfg and cfg.family,
                         architecture=cfg and cfg.architecture,
                         max_model_len=getattr(llm, "max_model_len", None),
                         root=getattr(llm, "model_path", None))

    @v1.get("/models")
    async def list_models() -> ModelList:
        """The served model, then each LoRA adapter (its parent the served model)."""
        base = model_card()
        return ModelList(data=[base, *loras.adapter_cards(ctx, base)])

    @v1.get("/stats")
    async def stats() -> dict:
        """The engine's state, rates and roofline position (servelm's own; the console's)."""
        report = live.report()
        if disaggregation is not None:
            report["kv_transfer"] = disaggregation.report()
        return report

    @v1.get("/cache_events")
    async def cache_events(request: Request) -> dict:
        """The prefix cache's stored / removed block digests after event `since` (of the
        log `instance`, when given: another one's numbers mean nothing here), for a
        cache-aware router; a snapshot instead when the log no longer reaches back."""
        query = request.query_params
        since, instance = query.get("since"), query.get("instance")
        if since is not None:  # read by hand: a bad one is a 400 in OpenAI's shape
            try:
                since = int(since)
            except ValueError:
                raise APIError(400, f"'since' is an event number, got {since!r}",
                               param="since", code="invalid_value") from None
        llm = getattr(engine, "engine", None)
        if llm is None:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        log = llm.block_manager.events
        if instance is not None and log is not None and instance != log.instance:
            since = None
        return stats_mod.cache_events(llm, since, bool(options.api_keys))

    @v1.get("/models/{name:path}")
    async def retrieve_model(name: str) -> ModelCard:
        lora = engine.loras.get(name)  # read once: the engine thread replaces the dict
        if lora is not None and name != model_name:
            return loras.card(model_card(), lora)
        check_model(name)  # a 404 unless it is the served model
        return model_card()

    async def generate(request: Request, schema: type[BaseModel], endpoint):
        """Read; parse, check the model and tokenise in a worker thread (their cost grows with
        the body, and the event loop serves everyone); start; then stream (SSE) or answer."""
        body = await read_body(request, options)

        def prepare():
            req = _parse(body, schema)
            lora = check_model(req.model)
            prepared = endpoint.prepare(ctx, req)
            prepared.lora = lora
            return req, prepared

        req, prepared = await asyncio.to_thread(prepare)
        target = None
        if req.kv_transfer_params is not None:
            if disaggregation is None:
                raise APIError(400, "this server does not move KV blocks",
                               param="kv_transfer_params", code="invalid_value")
            target = disaggregation.target(req.kv_transfer_params, req.stream,
                                           len(prepared.prompts), prepared.lora)
        salt = _cache_salt(request.state.key_salt, req.cache_salt, req.cache_prompt)
        gen = Generation(ctx, prepared, salt)
        if req.stream:
            return EventStreamResponse(endpoint.stream(ctx, req, gen), on_close=gen.close)
        answer = await _unless_disconnected(request, endpoint.complete(ctx, req, gen), gen)
        if target is not None and gen.finished and not isinstance(answer, Response):
            # The prompt ran: its KV to the decode server.
            answer.kv_transfer_params = await disaggregation.send(
                prepared.prompts[0][1], salt, target)
        return answer

    @v1.post("/chat/completions", **_openapi_body(ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionChunk))
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, chat)

    @v1.post("/completions", **_openapi_body(CompletionRequest, CompletionResponse,
                                             CompletionChunk))
    async def create_completion(request: Request):
        return await generate(request, CompletionRequest, completions)

    app.include_router(v1)
    app.include_router(console.router(bool(options.api_keys)))
    routes = Routes(ctx, options, check_api_key, check_model)
    for adapter in ADAPTERS:  # the other APIs, each a module with add_routes(app, routes)
        adapter.add_routes(app, routes)

    # vLLM's routes, outside /v1 as there, but behind the key like every other.
    async def parse_then(request: Request, schema: type[M], handle):
        body = await read_body(request, options)

        def run():
            req = _parse(body, schema)
            if req.model is not None:
                check_model(req.model)
            return handle(ctx, req)

        return await asyncio.to_thread(run)

    @app.post("/tokenize", dependencies=[Depends(check_api_key)],
              openapi_extra=_openapi_request(tokenize.TokenizeRequest))
    async def tokenize_route(request: Request) -> tokenize.TokenizeResponse:
        return await parse_then(request, tokenize.TokenizeRequest, tokenize.tokenize)

    @app.post("/detokenize", dependencies=[Depends(check_api_key)],
              openapi_extra=_openapi_request(tokenize.DetokenizeRequest))
    async def detokenize_route(request: Request) -> tokenize.DetokenizeResponse:
        return await parse_then(request, tokenize.DetokenizeRequest, tokenize.detokenize)

    @app.get("/health")
    async def health() -> dict:
        if engine.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not engine.healthy:
            raise APIError(503, f"the engine is not running: {engine.error or 'stopped'}",
                           code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _add_error_handlers(app)
    _add_schemas(app, [ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
                       CompletionRequest, CompletionResponse, CompletionChunk,
                       tokenize.TokenizeRequest, tokenize.DetokenizeRequest])
    private = access.require_key(app, options, check_api_key)  # /metrics, the docs
    openapi_errors.document_errors(app, options, private)
    return app


def _add_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the hand-parsed routes' models into /openapi.json's components."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {exc!r}", code="internal_error").response()
