"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A protocol adapter over the one generation path: the body (anthropic_protocol) becomes a
ChatCompletionRequest, chat.prepare renders and tokenises it (tool grammars included), and a
Generation runs it; the answer is rendered from its outputs as Anthropic's message, or as
its event stream (message_start, content_block_start / _delta / _stop, message_delta,
message_stop, and a ping). Tool calls come from the prepared tool parser, as chat's do; a
reasoning model's thought (the prepared reasoning parser's) is a thinking block before them
(streamed as thinking_delta; its signature empty: servelm signs nothing).

Errors on these routes, the key check's 401 included, are in Anthropic's shape:
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from servelm.server import chat
from servelm.server.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from servelm.server.errors import APIError, from_validation_error
from servelm.server.serving import Generation, Prepared, ServingContext
from servelm.server.sse import EventStreamResponse
from servelm.server.tools import ToolCallStream, ToolParser

if TYPE_CHECKING:
    from servelm.server.api import Routes

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 529: "overloaded_error"}
# The chat request's field names in errors -> this API's.
_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
           "response_format": "output_config.format",
           "response_format.json_schema.schema": "output_config.format.schema",
           "reasoning_effort": "output_config.effort",
           "chat_template_kwargs": "thinking"}


class AnthropicError(APIError):
    """An APIError answered in Anthropic's shape (the app's APIError handler calls
    response()). A full queue is Anthropic's 529 overloaded_error."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers=headers)
        self.type = _TYPES.get(status, "api_error" if status >= 500 else
                               "invalid_request_error")

    @classmethod
    def of(cls, e: APIError) -> AnthropicError:
        if isinstance(e, AnthropicError):
            return e
        status = 529 if e.code == "queue_full" else e.status
        param = _PARAMS.get(e.param, e.param)
        message = e.message
        if param and param != e.param:
            message = f"{param}: {message}"
        return cls(status, message, e.headers)

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def _invalid(e: ValidationError) -> AnthropicError:
    """A 400 naming the field. Where a union's members all fail, the problem servelm's own
    checks found (an image block, a server tool) is the one worth telling."""
    errors = e.errors(include_url=False)
    ours = [x for x in errors if x["type"] == "value_error"]
    if ours and ours[0] is not errors[0]:
        e = ValidationError.from_exception_data(e.title, ours[:1])
    err = from_validation_error(e)
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return AnthropicError(400, message)


def _parse(body: bytes, schema: type[CountTokensRequest]) -> CountTokensRequest:
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None


def prepare(ctx: ServingContext, req: CountTokensRequest) -> Prepared:
    """The request made ready (in a worker thread): chat.prepare over its chat request, then
    a prefill's text and tokens appended to the prompt."""
    try:
        chat_req, prefill = to_chat(req, ctx.model_name)
    except ValidationError as e:
        raise _invalid(e) from None
    except ValueError as e:
        raise AnthropicError(400, str(e)) from None
    prepared = chat.prepare(ctx, chat_req)
    (text, ids), = prepared.prompts
    if prefill:
        more = ctx.engine.tokenizer.encode(prefill, add_special_tokens=False)
        prepared.prompts = [(text + prefill, ids + more)]
        if prepared.reasoning_parser is not None:  # the prefill may open or close a thought
            prepared.reasoning_parser = prepared.reasoning_parser.for_prompt(text + prefill)
    # As Anthropic's newer models do: max_tokens past the context window stops there
    # (stop_reason model_context_window_exceeded) rather than being refused.
    room = ctx.engine.engine.max_model_len - len(prepared.prompts[0][1])
    if isinstance(req, MessagesRequest) and 1 <= room < req.max_tokens:
        prepared.params = replace(prepared.params, max_tokens=room)
    return prepared


def _call_id(parser: ToolParser) -> str:
    """Anthropic's tool_use id, unless the parser's format has ids of its own (Mistral's
    templates check theirs when a conversation comes back)."""
    if type(parser).new_call_id is not ToolParser.new_call_id:
        return parser.new_call_id()
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str | None) -> dict:
    """A call's input object from its JSON arguments ({} where they are not an object: a
    call cut short by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(o, called: bool, max_tokens: int) -> tuple[str, str | None]:
    """stop_reason and stop_sequence of a finished sample."""
    if o.finish_reason == "length":
        if len(o.token_ids) < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _usage(gen: Generation) -> dict:
    """Anthropic's usage: input_tokens excludes what the prefix cache served
    (cache_read_input_tokens); their sum is the prompt's length."""
    u = gen.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _message(msg_id: str, model: str) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None}


async def complete(ctx: ServingContext, req: MessagesRequest, gen: Generation
                   ) -> JSONResponse:
    """Run to the end and answer with one message."""
    (out,) = await gen.run()
    o = out.outputs[0]
    parser = gen.prepared.tool_parser
    thought, content, calls = None, o.text, []
    if gen.prepared.reasoning_parser is not None:
        thought, content = gen.prepared.reasoning_parser.split(o.text)
    if parser is not None:
        parsed = parser.parse(content, final=True)
        content = parsed.content
        calls = [c for c in parsed.calls if c.name is not None]
        if not gen.prepared.parallel_tool_calls:
            calls = calls[:1]
    blocks = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    blocks += [{"type": "text", "text": content}] if content else []
    blocks += [{"type": "tool_use", "id": _call_id(parser), "name": c.name,
                "input": _input(c.arguments)} for c in calls]
    stop_reason, stop_sequence = _stop(o, bool(calls), req.max_tokens)
    message = _message(f"msg_{uuid.uuid4().hex}", gen.model)
    message.update(content=blocks, stop_reason=stop_reason, stop_sequence=stop_sequence,
                   usage=_usage(gen))
    return JSONResponse(message)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The stream's content blocks, one open at a time; a ping follows the first start."""

    def __init__(self):
        self.count = 0
        self.open: str | None = None  # "text", "thinking", or the open tool_use block's id
        self.pinged = False
        self.calls: dict[int, int] = {}  # a call's index -> its block's index

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.count - 1})]

    def start(self, key: str, block: dict) -> list[str]:
        events = self.close()
        self.open = key
        self.count += 1
        events.append(_event("content_block_start", {"index": self.count - 1,
                                                     "content_block": block}))
        if not self.pinged:
            self.pinged = True
            events.append(_event("ping", {}))
        return events

    def text(self, piece: str, kind: str = "text") -> list[str]:
        """A piece of text (kind "text") or of a thought (kind "thinking")."""
        events = []
        if self.open != kind:
            block = ({"type": "text", "text": ""} if kind == "text" else
                     {"type": "thinking", "thinking": "", "signature": ""})
            events = self.start(kind, block)
        return events + [_event("content_block_delta", {
            "index": self.count - 1, "delta": {"type": f"{kind}_delta", kind: piece}})]

    def call(self, k: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events = []
        if call_id is not None:
            events = self.start(call_id, {"type": "tool_use", "id": call_id, "name": name,
                                          "input": {}})
            self.calls[k] = self.count - 1
        if arguments:
            events.append(_event("content_block_delta", {
                "index": self.calls[k],
                "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return events


async def stream(ctx: ServingContext, req: MessagesRequest, gen: Generation
                 ) -> AsyncIterator[str]:
    """Anthropic's event stream; thought, text and tool input as the engine writes them."""
    parser = gen.prepared.tool_parser
    calls = ToolCallStream(parser, gen.prepared.parallel_tool_calls) if parser else None
    reasoning = gen.prepared.reasoning_parser
    thoughts = reasoning.stream() if reasoning is not None else None
    answer = ""  # the answer so far, after any thought: what the tool parser reads
    blocks = _Blocks()
    start = _message(f"msg_{uuid.uuid4().hex}", gen.model)
    start["usage"] = {"input_tokens": sum(gen.prompt_lens), "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    yield _event("message_start", {"message": start})
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for _, out in outputs:
                o = out.outputs[0]
                events, pieces, thought, text = [], [], "", o.delta_text
                if thoughts is not None:
                    thought, text = thoughts.feed(o.delta_text, o.finished)
                answer += text
                if thought:
                    events += blocks.text(thought, "thinking")
                if calls is not None:
                    text, pieces = calls.feed(answer, final=o.finished)
                if text:
                    events += blocks.text(text)
                for p in pieces:
                    events += blocks.call(p.index, p.id and _call_id(parser), p.name,
                                          p.arguments)
                if o.finished:
                    if not blocks.pinged:
                        events.append(_event("ping", {}))
                    events += blocks.close()
                    stop_reason, stop_sequence = _stop(o, bool(calls and calls.called),
                                                       req.max_tokens)
                    events.append(_event("message_delta", {
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": _usage(gen)}))
                    events.append(_event("message_stop", {}))
                for e in events:
                    yield e
    except APIError as e:
        yield _event("error", {"error": AnthropicError.of(e).body()["error"]})


def add_routes(app: FastAPI, routes: Routes) -> None:
    """POST /v1/messages and /v1/messages/count_tokens, behind the API key (x-api-key or
    a bearer token), every error in Anthropic's shape."""
    ctx = routes.ctx

    async def check_api_key(request: Request) -> None:
        try:
            await routes.check_api_key(request)
        except APIError as e:
            raise AnthropicError.of(e) from None

    async def prepared_from(request: Request, schema: type[CountTokensRequest]):
        """Read; parse, check the model and prepare in a worker thread."""
        body = await routes.read(request)

        def work():
            req = _parse(body, schema)
            lora = routes.check_model(req.model)
            prepared = prepare(ctx, req)
            prepared.lora = lora
            return req, prepared

        return await asyncio.to_thread(work)

    async def answer(request: Request, work):
        """work() in Anthropic's error shape: any failure, the unexpected included."""
        try:
            return await work()
        except APIError as e:
            raise AnthropicError.of(e) from None
        except Exception as e:
            logger.exception("unhandled error on %s", request.url.path)
            raise AnthropicError(500, f"internal error: {e!r}") from None

    @app.post("/v1/messages", dependencies=[Depends(check_api_key)])
    async def create_message(request: Request):
        async def work():
            req, prepared = await prepared_from(request, MessagesRequest)
            gen = Generation(ctx, prepared, routes.cache_salt(request))
            if req.stream:
                return EventStreamResponse(stream(ctx, req, gen), on_close=gen.close)
            return await routes.unless_disconnected(request, complete(ctx, req, gen), gen)

        return await answer(request, work)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(check_api_key)])
    async def count_tokens(request: Request):
        async def work():
            _, prepared = await prepared_from(request, CountTokensRequest)
            return {"input_tokens": sum(len(ids) for _, ids in prepared.prompts)}

        return await answer(request, work)
