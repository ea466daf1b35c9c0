"""POST /v1/embeddings in OpenAI's shape, and `embed`, the coroutine other APIs' embedding
routes (Ollama's /api/embed) call.

Each input becomes one pooling request (servelm.pooling_params) on the engine every other
request runs on: the same scheduler, token budget, chunked prefill and admission control,
never sampled. The vector is the model's pooling of its final hidden states (the last
token's, L2-normalised, unless the checkpoint states another: LLMEngine.pooling_config)."""

from __future__ import annotations

import asyncio
import base64
import weakref
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, Request
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from servelm.engine.async_engine import (EngineDeadError, QueueFullError, RequestStream,
                                         ShuttingDownError)
from servelm.pooling_params import PoolingParams
from servelm.server.errors import APIError, from_validation_error
from servelm.server.protocol import Int
from servelm.server.serving import ServingContext, encode_prompt, new_id

if TYPE_CHECKING:
    from servelm.server.api import Routes

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request; `normalize` is vLLM's (None: the model's default)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: Any  # checked by hand (parse_inputs), so that each kind of mistake is named
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: str | None = None  # metadata: accepted, no effect
    normalize: bool | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


_WHAT = "a string, an array of strings, an array of token ids or an array of such arrays"


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_inputs(value: Any, param: str = "input") -> list[str | list[int]]:
    """The request's inputs, each a text or token ids: a string, strings, token ids, or
    lists of token ids (OpenAI's four shapes). Empty ones and other shapes: a 400 naming
    the field (and the entry)."""
    if isinstance(value, str) or (_is_ids(value) and value):
        items, single = [value], True
    elif isinstance(value, list) and value and (all(isinstance(x, str) for x in value)
                                                or all(_is_ids(x) for x in value)):
        items, single = value, False
    elif isinstance(value, list) and not value:
        raise APIError(400, f"'{param}' must not be empty", param=param, code="invalid_value")
    else:
        raise APIError(400, f"'{param}' must be {_WHAT}", param=param, code="invalid_value")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"'{param}' has {len(items)} entries; at most {MAX_INPUTS} a request",
                       param=param, code="invalid_value")
    for i, x in enumerate(items):
        if len(x) == 0:
            where = param if single else f"{param}[{i}]"
            raise APIError(400, f"'{where}' must not be empty", param=where,
                           code="invalid_value")
    return items


def _tokenize(ctx: ServingContext, items: list[str | list[int]], param: str) -> list[list[int]]:
    """Token ids of every input (texts tokenised, ids checked); a 400 names the entry."""
    engine = ctx.engine.engine
    out = []
    for i, x in enumerate(items):
        where = f"{param}[{i}]" if len(items) > 1 else param  # one input: the field
        ids = encode_prompt(ctx, x, {"": where}) if isinstance(x, str) else list(x)
        try:
            engine.prepare_prompt(None, PoolingParams(), ids)
        except ValueError as e:
            raise APIError(400, f"{where}: {e}", param=where, code="invalid_value") from None
        out.append(ids)
    return out


def _pooling_params(ctx: ServingContext, dimensions: int | None,
                    normalize: bool | None) -> PoolingParams:
    try:
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
        ctx.engine.engine.pooling_config.check(params)
    except ValueError as e:
        msg = str(e)
        param = "dimensions" if msg.startswith("dimensions") else "model"
        raise APIError(400, msg, param=param, code="invalid_value") from None
    return params


_COUNTERS: "weakref.WeakKeyDictionary[Any, SimpleNamespace]" = weakref.WeakKeyDictionary()


def _counters(ctx: ServingContext) -> SimpleNamespace:
    """This server's embedding counters, in its metrics registry (made on first use)."""
    c = _COUNTERS.get(ctx.metrics)
    if c is None:
        r = ctx.metrics.registry
        c = _COUNTERS[ctx.metrics] = SimpleNamespace(
            requests=Counter("servelm_embedding_requests",
                             "Embedding API requests answered.", registry=r),
            inputs=Counter("servelm_embedding_inputs",
                           "Inputs embedded (one pooling request each).", registry=r),
            prompt_tokens=Counter("servelm_embedding_prompt_tokens",
                                  "Prompt tokens of embedded inputs.", registry=r))
    return c


def _refused(e: Exception) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), code="server_shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    return APIError(400, str(e), param="input", code="invalid_value")


async def _vector(stream: RequestStream) -> list[float]:
    last = None
    try:
        async for out in stream:
            last = out
    except ShuttingDownError as e:
        raise APIError(503, f"{e}: the request did not finish within the shutdown timeout",
                       code="server_shutting_down") from e
    except Exception as e:  # the engine failed this request
        raise APIError(500, f"embedding failed: {e}", code="engine_error") from e
    return last.outputs.data.tolist()


async def embed(ctx: ServingContext, inputs: list[str | list[int]],
                dimensions: int | None = None, normalize: bool | None = None,
                cache_salt: str | None = None, param: str = "input"
                ) -> tuple[list[list[float]], int]:
    """Embed every input (a text, tokenised in a worker thread, or token ids): (one vector
    per input, in order; prompt tokens in all). Raises APIError: 400 naming `param` (or
    `param[i]`) for an input that cannot run, or `dimensions` for truncation the model was
    not trained for; 503 when the server is full (after this request's own inputs ahead
    of it have finished) or shutting down. Cancelled (a client gone), it aborts what it
    queued. Inputs past what admission control takes at once wait for earlier ones."""
    params = _pooling_params(ctx, dimensions, normalize)
    ids = await asyncio.to_thread(_tokenize, ctx, list(inputs), param)
    base = new_id("embd")
    streams: list[RequestStream] = []
    tasks: dict[asyncio.Future, int] = {}
    vectors: list[list[float] | None] = [None] * len(ids)
    try:
        nxt = 0
        while nxt < len(ids) or tasks:
            while nxt < len(ids):
                try:
                    stream = ctx.engine.encode(None, params, f"{base}-{nxt}",
                                               prompt_token_ids=ids[nxt], cache_salt=cache_salt)
                except (ValueError, QueueFullError, EngineDeadError) as e:
                    if not isinstance(e, QueueFullError) or not tasks:
                        raise _refused(e) from None
                    break  # full: this request's earlier inputs make room first
                streams.append(stream)
                tasks[asyncio.ensure_future(_vector(stream))] = nxt
                nxt += 1
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                vectors[tasks.pop(fut)] = fut.result()
    finally:
        for fut in tasks:
            fut.cancel()
        for s in streams:
            s.abort()
        c = _counters(ctx)
        finished = sum(v is not None for v in vectors)
        tokens = sum(len(x) for x, v in zip(ids, vectors) if v is not None)
        c.inputs.inc(finished)
        c.prompt_tokens.inc(tokens)
        ctx.metrics.prompt_tokens.inc(tokens)
    _counters(ctx).requests.inc()
    return vectors, sum(len(x) for x in ids)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, base64-encoded (OpenAI's)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _parse(body: bytes) -> EmbeddingRequest:
    from pydantic import ValidationError

    try:
        return EmbeddingRequest.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


# A non-streaming answer's disconnect watch cancels the task, whose `finally` aborts.
_NOTHING_TO_CLOSE = SimpleNamespace(close=lambda: None)


def add_routes(app: FastAPI, routes: "Routes") -> None:
    """POST /v1/embeddings, behind the API key like every /v1 route."""
    ctx = routes.ctx
    _counters(ctx)  # exported at 0 before the first request

    async def answer(req: EmbeddingRequest, salt: str | None) -> EmbeddingResponse:
        vectors, tokens = await embed(ctx, parse_inputs(req.input), req.dimensions,
                                      req.normalize, salt)
        return EmbeddingResponse(
            id=new_id("embd"), model=ctx.model_name,
            data=[Embedding(index=i, embedding=_encode(v, req.encoding_format))
                  for i, v in enumerate(vectors)],
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    @app.post("/v1/embeddings", dependencies=[Depends(routes.check_api_key)],
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": EmbeddingRequest.model_json_schema()}}}},
              response_model=EmbeddingResponse)
    async def create_embeddings(request: Request):
        body = await routes.read(request)

        def parse() -> EmbeddingRequest:
            req = _parse(body)
            if routes.check_model(req.model) is not None:
                raise APIError(400, f"'{req.model}' is a LoRA adapter; embeddings come from the "
                                    f"base model only: send model '{ctx.model_name}'",
                               param="model", code="invalid_value")
            return req

        req = await asyncio.to_thread(parse)
        salt = routes.cache_salt(request)
        return await routes.unless_disconnected(request, answer(req, salt), _NOTHING_TO_CLOSE)
