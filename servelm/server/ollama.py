"""Ollama's native API over servelm's one generation path: POST /api/chat and /api/generate
(NDJSON streams by default, one JSON object with "stream": false), GET /api/tags, POST
/api/show, GET /api/ps, GET /api/version and POST /api/embed.

A request becomes servelm's own (a ChatCompletionRequest through chat.prepare; a raw
/api/generate prompt, or one for a model without a chat template, a CompletionRequest
through completions.prepare), then a Generation, whose outputs are rendered in Ollama's
shape: message / response, done, done_reason, and the durations in nanoseconds from the
request's metrics. Errors are Ollama's {"error": "..."} with a 4xx (a stream that already
started ends with such a line), behind the same API key as every other route."""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

import servelm
from servelm.outputs import RequestOutput
from servelm.server import chat, completions
from servelm.server.errors import APIError, from_validation_error
from servelm.server.ollama_models import ServedModel, check_model, timestamp
from servelm.server.ollama_protocol import (FIELD_NAMES, ChatRequest, EmbedRequest,
                                            GenerateRequest, ShowRequest, _Generating,
                                            chat_messages)
from servelm.server.protocol import ChatCompletionRequest, CompletionRequest
from servelm.server.serving import (Generation, Prepared, ServingContext, TokenText,
                                    new_logprobs)
from servelm.server.tools import ToolCallStream
from servelm.server.sse import EventStreamResponse

try:
    from servelm.server import embeddings
except ImportError:  # a build without the embeddings API: /api/embed answers 501
    embeddings = None

if TYPE_CHECKING:
    from servelm.server.api import Routes

NDJSON = "application/x-ndjson"
# A non-streaming embedding's disconnect watch cancels its task, whose `finally` aborts.
_NOTHING_TO_CLOSE = SimpleNamespace(close=lambda: None)
_RENAMED = re.compile(r"(?<![\w.])(" + "|".join(
    re.escape(k) for k in sorted(FIELD_NAMES, key=len, reverse=True)) + r")(?![\w])")


def _error(e: APIError) -> JSONResponse:
    """Ollama's error body: {"error": "..."}."""
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def _renamed(e: APIError) -> APIError:
    """An error of the internal request, in the Ollama request's field names."""
    message = _RENAMED.sub(lambda m: FIELD_NAMES[m[1]], e.message)
    return APIError(e.status, message, param=FIELD_NAMES.get(e.param or "", e.param),
                    code=e.code, headers=e.headers)


def _parse(body: bytes, schema: type[BaseModel]) -> Any:
    if not body.strip():
        raise APIError(400, "missing request body")
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


# ---- requests -> Prepared -----------------------------------------------------------------


@dataclass
class _Job:
    """A prepared generation and how its answer is shaped."""

    prepared: Prepared
    chat: bool          # a message (/api/chat) or a response (/api/generate)
    context: bool       # /api/generate (not raw): the final answer carries its context


def _internal(ctx: ServingContext, schema: type[BaseModel], endpoint, fields: dict) -> Prepared:
    """The internal request built and prepared; its errors named as Ollama's fields."""
    try:
        return endpoint.prepare(ctx, schema.model_validate(fields))
    except ValidationError as e:
        raise _renamed(from_validation_error(e)) from None
    except APIError as e:
        raise _renamed(e) from None


def _thinking(ctx: ServingContext, req: _Generating) -> dict[str, Any]:
    """`think` as template variables: false turns a reasoning template's thinking off
    (Qwen3-style enable_thinking), true or a level ("low" ...) on (the level also as
    reasoning_effort); either way the thought comes back apart, in `thinking`. Asking a
    model servelm reads no thoughts from (no --reasoning-parser) to think is refused, as
    Ollama refuses it for a model without the thinking capability."""
    if req.think is None:
        return {}
    if req.think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if getattr(ctx, "reasoning_parser", None) is None:
        raise APIError(400, f'"{req.model}" does not support thinking (servelm reads no '
                            f"thought apart from this model's answers: see --reasoning-parser)",
                       param="think")
    if req.think is True:
        return {"chat_template_kwargs": {"enable_thinking": True}}
    return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": req.think}


def _logprob_fields(req: _Generating, chat_shaped: bool) -> dict[str, Any]:
    if not req.logprobs:
        return {}
    if chat_shaped:
        return {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    return {"logprobs": req.top_logprobs or 0}


def _check_num_ctx(ctx: ServingContext, req: _Generating) -> None:
    num_ctx, max_len = req.options.num_ctx, ctx.engine.engine.max_model_len
    if num_ctx is not None and num_ctx > max_len:
        raise APIError(400, f"options.num_ctx {num_ctx} is over this server's context length "
                            f"({max_len} tokens; servelm serve --max-model-len)",
                       param="options.num_ctx")


def _limited(prepared: Prepared, req: _Generating) -> Prepared:
    """The output limit: num_predict, and within num_ctx with the prompt."""
    limit = req.options.max_tokens()
    num_ctx, prompt = req.options.num_ctx, len(prepared.prompts[0][1])
    if num_ctx is not None:
        room = num_ctx - prompt
        if room < 1:
            raise APIError(400, f"the prompt is {prompt} tokens, which leaves no room to answer "
                                f"within options.num_ctx ({num_ctx})", param="options.num_ctx")
        limit = min(limit or room, room)
    return replace(prepared, params=replace(prepared.params, max_tokens=limit))


def _prepare_chat(ctx: ServingContext, req: ChatRequest) -> _Job | None:
    _check_num_ctx(ctx, req)
    if not req.messages:
        return None  # Ollama's "load the model" request
    fields = {**req.internal(), "model": ctx.model_name, "messages": chat_messages(req.messages),
              **_thinking(ctx, req), **_logprob_fields(req, True)}
    if req.tools:
        fields["tools"] = req.tools
    prepared = _internal(ctx, ChatCompletionRequest, chat, fields)
    return _Job(_limited(prepared, req), chat=True, context=False)


def _prepare_generate(ctx: ServingContext, req: GenerateRequest) -> _Job | None:
    _check_num_ctx(ctx, req)
    if not req.prompt:
        return None  # Ollama's "load the model" request
    base = {**req.internal(), "model": ctx.model_name}
    templated = not req.raw and bool(ctx.engine.tokenizer.chat_template)
    if templated:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        messages.append({"role": "user", "content": req.prompt})
        prepared = _internal(ctx, ChatCompletionRequest, chat, {
            **base, "messages": messages, **_thinking(ctx, req), **_logprob_fields(req, True)})
    else:
        if req.system:
            raise APIError(400, "'system' needs a chat template to go in, and this model has "
                                "none: put it in the prompt", param="system")
        prepared = _internal(ctx, CompletionRequest, completions, {
            **base, "prompt": req.prompt, "max_tokens": None, **_logprob_fields(req, False)})
    if req.context:
        vocab = min(ctx.engine.engine.model_config.vocab_size, ctx.engine.tokenizer.vocab_size)
        bad = next((t for t in req.context if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"context holds {bad}, which is not a token id of this model "
                                f"([0, {vocab}))", param="context")
        text, ids = prepared.prompts[0]
        prepared = replace(prepared, prompts=[(text, list(req.context) + ids)])
    return _Job(_limited(prepared, req), chat=False, context=not req.raw)


# ---- Generation -> Ollama's answers -------------------------------------------------------


def _arguments(text: str) -> dict:
    """A call's arguments as the object Ollama sends (a JSON value that is not an object is
    wrapped as {"value": ...})."""
    value = json.loads(text) if text else {}
    return value if isinstance(value, dict) else {"value": value}


def _tool_call(index: int, call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "function": {"index": index, "name": name,
                                        "arguments": _arguments(arguments)}}


@dataclass
class _Answer:
    """One request's answer in Ollama's shape, whole or as NDJSON lines."""

    ctx: ServingContext
    req: _Generating
    gen: Generation
    job: _Job
    start: float   # when the request arrived (perf_counter)
    ready: float   # when it was handed to the engine

    def _body(self, text: str, lp: list | None, final: RequestOutput | None,
              tool_calls: list[dict] | None = None, thought: str | None = None) -> dict:
        out: dict[str, Any] = {"model": self.req.model, "created_at": timestamp()}
        if self.job.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thought:
                out["message"]["thinking"] = thought
            if tool_calls:
                out["message"]["tool_calls"] = tool_calls
        else:
            out["response"] = text
            if thought:
                out["thinking"] = thought
        if lp:
            out["logprobs"] = lp
        out["done"] = final is not None
        if final is not None:
            out.update(self._final(final))
        return out

    def _final(self, out: RequestOutput) -> dict:
        """done_reason, the counts and durations (ns), and /api/generate's context."""
        o = out.outputs[0]
        m = o.metrics
        fields: dict[str, Any] = {
            "done_reason": o.finish_reason, "total_duration": _ns(time.perf_counter() - self.start),
            "load_duration": _ns(self.ready - self.start),
            "prompt_eval_count": self.gen.prompt_lens[0], "eval_count": len(o.token_ids)}
        if m is not None and m.first_token_time is not None:
            if m.first_scheduled_time is not None:
                fields["prompt_eval_duration"] = _ns(m.first_token_time - m.first_scheduled_time)
            fields["eval_duration"] = _ns((m.last_token_time or m.first_token_time)
                                          - m.first_token_time)
        if self.job.context:
            fields["context"] = list(out.prompt_token_ids) + list(o.token_ids)
        return fields

    def _logprobs(self, entries: list) -> list[dict] | None:
        if not self.req.logprobs:
            return None
        text = TokenText(self.ctx.engine.tokenizer)

        def one(token_id: int, logprob: float) -> dict:
            top = text.top(token_id, logprob)
            return {"token": top.token, "logprob": top.logprob, "bytes": top.bytes}

        return [{**one(e.token_id, e.logprob),
                 "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    async def complete(self) -> JSONResponse:
        (out,) = await self.gen.run()
        o = out.outputs[0]
        prepared = self.gen.prepared
        text, calls, thought = o.text, None, None
        if prepared.tool_parser is not None or getattr(prepared, "reasoning_parser", None):
            message, _ = chat._message(prepared, o.text, o.finish_reason)
            text, thought = message.content or "", getattr(message, "reasoning_content", None)
            calls = [_tool_call(i, c.id, c.function.name, c.function.arguments)
                     for i, c in enumerate(message.tool_calls)]
        return JSONResponse(self._body(text, self._logprobs(o.logprobs or []), out, calls,
                                       thought))

    async def stream(self) -> AsyncIterator[str]:
        """A line per step with new text (a reasoning model's thought apart, in `thinking`);
        the last (done) carries the tool calls, whole (as Ollama sends them), and the counts."""
        prepared = self.gen.prepared
        calls = (ToolCallStream(prepared.tool_parser, prepared.parallel_tool_calls)
                 if prepared.tool_parser is not None else None)
        reasoning = getattr(prepared, "reasoning_parser", None)
        thoughts = reasoning.stream() if reasoning is not None else None
        found: dict[int, list[str]] = {}  # call index -> [id, name, arguments so far]
        answer, sent = "", 0
        try:
            async with aclosing(self.gen.outputs()) as outputs:
                async for _, out in outputs:
                    o = out.outputs[0]
                    if not o.delta_token_ids and not o.finished:
                        continue
                    text, thought = o.delta_text, ""
                    if thoughts is not None:
                        thought, text = thoughts.feed(o.delta_text, o.finished)
                    answer += text
                    if calls is not None:
                        text, pieces = calls.feed(answer, final=o.finished)
                        for p in pieces:
                            found.setdefault(p.index, [p.id or "", p.name or "", ""])[2] += \
                                p.arguments
                    lp = self._logprobs(new_logprobs(o, sent))
                    sent = len(o.token_ids)
                    if o.finished:
                        tool_calls = [_tool_call(i, *found[i]) for i in sorted(found)]
                        yield _line(self._body(text, lp, out, tool_calls, thought))
                    elif text or thought or lp:
                        yield _line(self._body(text, lp, None, thought=thought))
        except APIError as e:
            yield _line({"error": e.message})


def _loaded(req: _Generating, chat_shaped: bool) -> dict:
    """The answer to a request with nothing to generate: the model is loaded (it always is)."""
    out: dict[str, Any] = {"model": req.model, "created_at": timestamp()}
    if chat_shaped:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return {**out, "done": True, "done_reason": "load"}


def _ndjson(lines: AsyncIterator[str], on_close: Callable[[], None]) -> Response:
    """A stream of JSON lines that stops, and aborts its request, when the client leaves."""
    response = EventStreamResponse(lines, on_close=on_close)
    response.headers["content-type"] = NDJSON
    return response


# ---- routes -------------------------------------------------------------------------------


def add_routes(app: FastAPI, routes: Routes) -> None:
    """Ollama's routes on `app`, each behind routes.check_api_key, answering in its shape."""
    ctx = routes.ctx
    model: list[ServedModel] = []

    async def served() -> ServedModel:
        llm = getattr(ctx.engine, "engine", None)
        if llm is None:
            raise APIError(503, "the model is still loading")
        if not model:
            def make() -> ServedModel:
                made = ServedModel(llm, ctx.model_name)
                made.details  # the file's header read here, off the event loop
                return made

            made = await asyncio.to_thread(make)
            model[:] = model or [made]
        return model[0]

    async def guarded(request: Request, handle: Callable[[], Awaitable[Any]]) -> Any:
        try:
            await routes.check_api_key(request)
            return await handle()
        except APIError as e:
            return _error(e)

    async def generate(request: Request, schema: type[_Generating], prepare) -> Any:
        start = time.perf_counter()
        body = await routes.read(request)

        def parse_and_prepare():
            req = _parse(body, schema)
            lora = check_model(ctx.model_name, req.model, ctx.engine.loras)
            job = prepare(ctx, req)
            if job is not None:
                job.prepared.lora = lora
            return req, job

        req, job = await asyncio.to_thread(parse_and_prepare)
        if job is None:
            return JSONResponse(_loaded(req, schema is ChatRequest))
        gen = Generation(ctx, job.prepared, routes.cache_salt(request))
        answer = _Answer(ctx, req, gen, job, start, time.perf_counter())
        if req.stream:
            return _ndjson(answer.stream(), gen.close)
        return await routes.unless_disconnected(request, answer.complete(), gen)

    @app.post("/api/chat", tags=["ollama"])
    async def ollama_chat(request: Request):
        return await guarded(request, lambda: generate(request, ChatRequest, _prepare_chat))

    @app.post("/api/generate", tags=["ollama"])
    async def ollama_generate(request: Request):
        return await guarded(request,
                             lambda: generate(request, GenerateRequest, _prepare_generate))

    @app.get("/api/tags", tags=["ollama"])
    async def ollama_tags(request: Request):
        async def tags():
            base = await served()
            adapters = [(r.lora_name, r.lora_path) for r in ctx.engine.loras.values()]
            return {"models": [base.entry(), *await asyncio.to_thread(
                lambda: [base.adapter_entry(*a) for a in adapters])]}
        return await guarded(request, tags)

    @app.get("/api/ps", tags=["ollama"])
    async def ollama_ps(request: Request):
        async def ps():
            base = await served()
            adapters = [(r.lora_name, r.lora_path) for r in ctx.engine.loras.values()]
            return {"models": [base.running(), *await asyncio.to_thread(
                lambda: [base.running(base.adapter_entry(*a)) for a in adapters])]}
        return await guarded(request, ps)

    @app.get("/api/version", tags=["ollama"])
    async def ollama_version(request: Request):
        async def version():
            return {"version": servelm.__version__}
        return await guarded(request, version)

    @app.post("/api/show", tags=["ollama"])
    async def ollama_show(request: Request):
        async def show():
            req = _parse(await routes.read(request), ShowRequest)
            name = req.model or req.name
            if not name:
                raise APIError(400, "model is required")
            lora = check_model(ctx.model_name, name, ctx.engine.loras)
            body = await asyncio.to_thread((await served()).show)
            if lora is not None:  # the base's, as the adapter's parent
                body["details"] = {**body["details"], "parent_model": (await served()).name}
            return body
        return await guarded(request, show)

    @app.post("/api/embed", tags=["ollama"])
    async def ollama_embed(request: Request):
        async def embed():
            start = time.perf_counter()
            req = _parse(await routes.read(request), EmbedRequest)
            if check_model(ctx.model_name, req.model, ctx.engine.loras) is not None:
                raise APIError(400, f"'{req.model}' is a LoRA adapter; embeddings come from "
                                    f"the base model only: send model '{ctx.model_name}'")
            if embeddings is None:
                raise APIError(501, "/api/embed is not available: this servelm build has no "
                                    "embeddings API")
            inputs = req.inputs()
            body: dict[str, Any] = {"model": req.model, "embeddings": []}
            if inputs:
                # Ollama's vectors are L2-normalised, and cut to `dimensions` when asked.
                work = embeddings.embed(ctx, inputs, req.dimensions, True,
                                        routes.cache_salt(request))
                done = await routes.unless_disconnected(request, work, _NOTHING_TO_CLOSE)
                if isinstance(done, Response):
                    return done
                body["embeddings"], body["prompt_eval_count"] = done
            return {**body, "total_duration": _ns(time.perf_counter() - start),
                    "load_duration": 0}
        return await guarded(request, embed)
