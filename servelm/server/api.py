"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, SSE with disconnect detection."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Callable, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm.engine.async_engine import AsyncLLMEngine
from servelm.server import chat, completions
from servelm.server.errors import APIError, from_validation_error
from servelm.server.metrics import CONTENT_TYPE, ServerMetrics
from servelm.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                     ModelList)
from servelm.server.serving import Generation, ServingContext

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and abort their requests, as soon as the client leaves.

    Starlette only listens for the disconnect under old ASGI versions; here we always do,
    so a request still waiting in the queue (sending nothing) is aborted too.
    """

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection closed mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def _parse(request: Request, model: type[M]) -> M:
    # Parsed by hand (not as a FastAPI body parameter) so that any content type is accepted
    # and every failure maps to one OpenAI-shaped 400.
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e) from None


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
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening for it
    return task.result()


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """An app serving `engine` as `model_name`; the engine thread runs for the app's lifespan.

    With api_key set, every /v1 route needs `Authorization: Bearer <api_key>`.
    """
    metrics = ServerMetrics(engine)
    ctx = ServingContext(engine, metrics, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="servelm", lifespan=lifespan)
    app.state.ctx = ctx

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{model_name}'", param="model", code="model_not_found")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card() -> ModelCard:
        llm = getattr(engine, "engine", None)  # None until the engine thread has built it
        cfg = getattr(llm, "model_config", None)
        return ModelCard(id=model_name, family=cfg and cfg.family,
                         architecture=cfg and cfg.architecture,
                         max_model_len=getattr(llm, "max_model_len", None))

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @v1.get("/models/{name:path}")
    async def retrieve_model(name: str) -> ModelCard:
        check_model(name)
        return model_card()

    async def generate(request: Request, schema: type[BaseModel], endpoint):
        """Parse, check the model, start; then stream (SSE) or answer once."""
        req = await _parse(request, schema)
        check_model(req.model)
        gen = endpoint.start(ctx, req)
        if req.stream:
            return EventStreamResponse(endpoint.stream(ctx, req, gen), on_close=gen.close)
        return await _unless_disconnected(request, endpoint.complete(ctx, req, gen), gen)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, chat)

    @v1.post("/completions")
    async def create_completion(request: Request):
        return await generate(request, CompletionRequest, completions)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict:
        if not engine.healthy:
            raise APIError(503, f"the engine is not running: {engine.error or 'stopped'}",
                           code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _add_error_handlers(app)
    return app


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
