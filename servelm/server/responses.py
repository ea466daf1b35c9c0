"""POST /v1/responses: OpenAI's Responses API, an adapter over the chat path.

A request's input items become a ChatCompletionRequest (instructions a system message,
function_call items an assistant turn's tool_calls, function_call_output items tool turns),
which chat.prepare renders and Generation runs, as every API here does. The answer is read as
chat reads it (the prepared reasoning parser, then the tool parser) and written as output
items: a reasoning item with reasoning_text (a reasoning model's thought), a message with
output_text, and function_call items. Streamed, the same items are built event by event
(`response.output_item.added`, deltas, `.done`s), each event numbered.

servelm keeps no responses: every request is store=false, a previous_response_id is a 400,
and GET /v1/responses/{id} is a 404 saying so. Keeping them would tie a conversation to one
server process and its memory; a client that sends the conversation back whole (as the
Responses API's own store=false mode asks) works against any servelm.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ValidationError

from servelm.server import chat
from servelm.server.errors import APIError, from_validation_error
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.responses_protocol import (AllowedTools, FunctionCallItem,
                                               FunctionCallOutputItem, FunctionChoice,
                                               FunctionTool, IncompleteDetails,
                                               InputTokensDetails, MessageItem, OutputFunctionCall,
                                               OutputItem, OutputMessage, OutputReasoning,
                                               OutputText, OutputTokensDetails, ReasoningText,
                                               ResponseError,
                                               ResponseObject, ResponsesRequest, ResponseUsage,
                                               ToolChoice, parse_items, parse_tool_choice,
                                               parse_tools)
from servelm.server.serving import Generation, Prepared, ServingContext
from servelm.server.sse import EventStreamResponse
from servelm.server.tools import ToolCallStream

if TYPE_CHECKING:
    from servelm.server.api import Routes

# The chat request's field names -> this API's, for the errors chat.prepare and the engine raise.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text.format",
           "response_format.json_schema.schema": "text.format.schema",
           "reasoning_effort": "reasoning.effort"}


def _id(prefix: str) -> str:
    """An id as OpenAI writes them: 'resp_<32 hex digits>', 'msg_...', 'fc_...'."""
    return f"{prefix}_{uuid.uuid4().hex}"


def add_routes(app: FastAPI, routes: Routes) -> None:
    ctx = routes.ctx

    @app.post("/v1/responses", dependencies=[Depends(routes.check_api_key)],
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}}})
    async def create_response(request: Request):
        body = await routes.read(request)

        def prepare() -> tuple[ResponsesRequest, Prepared, ResponseObject]:
            try:
                req = ResponsesRequest.model_validate_json(body)
            except ValidationError as e:
                raise from_validation_error(e) from None
            lora = routes.check_model(req.model)
            prepared, shell = prepare_request(ctx, req)
            prepared.lora = lora
            return req, prepared, shell

        req, prepared, shell = await asyncio.to_thread(prepare)
        gen = Generation(ctx, prepared, routes.cache_salt(request))
        if req.stream:
            return EventStreamResponse(stream(gen, shell), on_close=gen.close)
        return await routes.unless_disconnected(request, complete(gen, shell), gen)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(routes.check_api_key)])
    async def retrieve_response(response_id: str):
        raise APIError(404, f"no response '{response_id}': servelm keeps no responses (every "
                            f"request is store=false)", param="response_id", code="not_found")

    _document(app)


def _document(app: FastAPI) -> None:
    """The hand-parsed request's schema in /openapi.json's components."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            js = ResponsesRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.update(js.pop("$defs", {}))
            comps["ResponsesRequest"] = js
        return app.openapi_schema

    app.openapi = openapi


# ---- the request as a chat request ----------------------------------------------------------


def prepare_request(ctx: ServingContext, req: ResponsesRequest
                    ) -> tuple[Prepared, ResponseObject]:
    """The chat request behind `req`, prepared (rendered, tokenised, its grammar compiled), and
    the response object it will answer with, its parameters filled in; a bad request raises
    APIError naming this API's field."""
    items = parse_items(req.input)
    tools = parse_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools)
    chat_tools, chat_choice = _chat_tools(tools, choice)
    fmt = req.text.format if req.text else None
    body: dict[str, Any] = {
        "model": req.model, "messages": to_messages(req.instructions, items),
        "max_completion_tokens": req.max_output_tokens, "stream": req.stream,
        "tools": chat_tools, "tool_choice": chat_choice,
        "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_),
                              ("description", fmt.description), ("strict", fmt.strict))
            if v is not None}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    try:
        chat_req = ChatCompletionRequest.model_validate_json(json.dumps(body))
        prepared = chat.prepare(ctx, chat_req)
    except ValidationError as e:
        raise _renamed(from_validation_error(e)) from None
    except APIError as e:
        raise _renamed(e) from None
    prepared.fields = {k: _PARAMS.get(v, v) for k, v in prepared.fields.items()}
    return prepared, _shell(ctx, req, tools, choice)


def to_messages(instructions: str | None, items: list) -> list[dict]:
    """The conversation as chat messages: instructions first, as a system message; a
    function_call joins the assistant turn before it (or opens one); reasoning is left out."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    called: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text_parts()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise APIError(400, f"no function_call item before input[{i}] has call_id "
                                    f"{item.call_id!r}", param=f"input[{i}].call_id",
                               code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text})
    if not messages:
        raise APIError(400, "'input' holds no message or function call", param="input",
                       code="invalid_value")
    return messages


def _chat_tools(tools: list[FunctionTool], choice: ToolChoice
                ) -> tuple[list[dict] | None, Any]:
    """The tools and tool_choice in chat's shape (allowed_tools: only those tools offered)."""
    if isinstance(choice, AllowedTools):
        allowed = {t.name for t in choice.tools}
        tools, choice = [t for t in tools if t.name in allowed], choice.mode
    if not tools:
        return None, None
    chat_tools = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                 exclude_none=True)}
                  for t in tools]
    if isinstance(choice, FunctionChoice):
        return chat_tools, {"type": "function", "function": {"name": choice.name}}
    return chat_tools, choice


def _renamed(e: APIError) -> APIError:
    """An error chat or the engine raised, naming this API's field instead of chat's."""
    param = e.param
    if param is None:
        return e
    head = param.split("[")[0].split(".")[0]
    new = _PARAMS.get(param) or (_PARAMS[head] if head in _PARAMS else param)
    message = e.message.replace(param, new) if param != new else e.message
    return APIError(e.status, message, param=new, code=e.code, type=e.type, headers=e.headers)


def _shell(ctx: ServingContext, req: ResponsesRequest, tools: list[FunctionTool],
           choice: ToolChoice) -> ResponseObject:
    """The response before anything is generated: in progress, with the request's
    parameters as they apply."""
    fmt = req.text.format if req.text else None
    reasoning = req.reasoning
    return ResponseObject(
        id=_id("resp"), status="in_progress", model=req.model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls, parallel_tool_calls=req.parallel_tool_calls is not False,
        reasoning={"effort": reasoning and reasoning.effort,
                   "summary": reasoning and reasoning.summary},
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        text={"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                         else {"type": "text"}),
              "verbosity": (req.text and req.text.verbosity) or "medium"},
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        tools=[t.model_dump() for t in tools], metadata=req.metadata or {}, user=req.user,
        safety_identifier=req.safety_identifier, prompt_cache_key=req.prompt_cache_key)


# ---- the answer --------------------------------------------------------------------------------


def answer_items(prepared: Prepared, text: str) -> list[OutputItem]:
    """The whole answer as output items, read as chat reads it: its thought as a reasoning
    item, its content as a message (also when empty and there are no calls or thought), then
    its function calls."""
    items: list[OutputItem] = []
    reasoning = getattr(prepared, "reasoning_parser", None)
    if reasoning is not None:
        thought, text = reasoning.split(text)
        if thought is not None:
            items.append(OutputReasoning(id=_id("rs"), status="completed",
                                         content=[ReasoningText(text=thought)]))
    parser, content, calls = prepared.tool_parser, text, []
    if parser is not None:
        parsed = parser.parse(text, final=True)
        calls = [c for c in parsed.calls if c.name is not None]
        if not prepared.parallel_tool_calls:
            calls = calls[:1]
        content = parsed.content
    if content or not (calls or items):
        items.append(OutputMessage(id=_id("msg"), status="completed",
                                   content=[OutputText(text=content)]))
    items += [OutputFunctionCall(id=_id("fc"), status="completed", call_id=parser.new_call_id(),
                                 name=c.name, arguments=c.arguments or "") for c in calls]
    return items


def _finished(shell: ResponseObject, items: list[OutputItem], finish_reason: str | None,
              gen: Generation) -> ResponseObject:
    """The response once generation ended: incomplete (its last item too) where the output
    ran into max_output_tokens."""
    incomplete = finish_reason == "length"
    if incomplete and items:
        items[-1].status = "incomplete"
    u = gen.usage()
    thought = "".join(c.text for item in items if isinstance(item, OutputReasoning)
                      for c in item.content)
    # The thought's tokens, counted by re-tokenising its text (without its tags).
    reasoning_tokens = (len(gen.ctx.engine.tokenizer.encode(thought, add_special_tokens=False))
                        if thought else 0)
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    usage = ResponseUsage(input_tokens=u.prompt_tokens,
                          input_tokens_details=InputTokensDetails(cached_tokens=cached),
                          output_tokens=u.completion_tokens,
                          output_tokens_details=OutputTokensDetails(
                              reasoning_tokens=reasoning_tokens),
                          total_tokens=u.total_tokens)
    return shell.model_copy(update={
        "status": "incomplete" if incomplete else "completed", "output": items, "usage": usage,
        "completed_at": None if incomplete else int(time.time()),
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete
        else None})


async def complete(gen: Generation, shell: ResponseObject) -> ResponseObject:
    """Run to the end and answer with the whole response."""
    (out,) = await gen.run()
    o = out.outputs[0]
    return _finished(shell, answer_items(gen.prepared, o.text), o.finish_reason, gen)


# ---- streaming ---------------------------------------------------------------------------------


class _Events:
    """Server-sent events as OpenAI sends them: the type as the event name, and a sequence
    number in each."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence,
                **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                   for k, v in fields.items()}}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamedItems:
    """The output items of a streamed answer, built as its text grows: a reasoning item opens
    at the thought's first text, a message at the answer's first content, a function_call
    at each call's header; whichever item was open closes when another opens, or at the end.
    Joined, they are what answer_items makes of the whole answer."""

    def __init__(self, prepared: Prepared, events: _Events):
        self.events = events
        parser = prepared.tool_parser
        self.calls = (ToolCallStream(parser, prepared.parallel_tool_calls) if parser is not None
                      else None)
        reasoning = getattr(prepared, "reasoning_parser", None)
        self.thought = reasoning.stream() if reasoning is not None else None
        self.answer = ""  # the answer after the thought, so far: what the tool parser reads
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.by_call: dict[int, OutputFunctionCall] = {}  # the ToolCallStream's index -> item

    def feed(self, delta: str, final: bool) -> list[str]:
        """The events for one step's new text (`final`: the answer ends with it)."""
        thought, answer = "", delta
        if self.thought is not None:
            thought, answer = self.thought.feed(delta, final)
        self.answer += answer
        out = self._write(OutputReasoning, thought) if thought else []
        content, pieces = ((answer, []) if self.calls is None
                           else self.calls.feed(self.answer, final))
        if content:
            out += self._write(OutputMessage, content)
        for p in pieces:
            if p.id is not None:
                out += self._add(OutputFunctionCall(id=_id("fc"), status="in_progress",
                                                    call_id=p.id, name=p.name, arguments=""))
                self.by_call[p.index] = self.open
            if p.arguments:
                item = self.by_call[p.index]
                item.arguments += p.arguments
                out.append(self.events("response.function_call_arguments.delta",
                                       item_id=item.id, output_index=self.items.index(item),
                                       delta=p.arguments))
        return out

    def finish(self, incomplete: bool) -> list[str]:
        """Close the open item (incomplete where the output was cut short)."""
        out = [] if self.items else self._write(OutputMessage, "")  # an empty answer
        return out + self._close("incomplete" if incomplete else "completed")

    def _write(self, kind: type[OutputMessage] | type[OutputReasoning], text: str) -> list[str]:
        """`text` added to the open message or reasoning item (opened first if another is)."""
        out, message = [], kind is OutputMessage
        if not isinstance(self.open, kind):
            out += self._add(kind(id=_id("msg" if message else "rs"), status="in_progress"))
            part = OutputText(text="") if message else ReasoningText(text="")
            out.append(self.events("response.content_part.added", item_id=self.open.id,
                                   output_index=len(self.items) - 1, content_index=0, part=part))
            self.open.content.append(part)
        if text:
            self.open.content[0].text += text
            out.append(self.events(
                "response.output_text.delta" if message else "response.reasoning_text.delta",
                item_id=self.open.id, output_index=len(self.items) - 1, content_index=0,
                delta=text, **({"logprobs": []} if message else {})))
        return out

    def _add(self, item: OutputItem) -> list[str]:
        out = self._close("completed")
        self.items.append(item)
        self.open = item
        return out + [self.events("response.output_item.added", item=item,
                                  output_index=len(self.items) - 1)]

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self.items.index(item), []
        if isinstance(item, OutputFunctionCall):
            out.append(self.events("response.function_call_arguments.done", item_id=item.id,
                                   output_index=index, arguments=item.arguments))
        else:
            part = item.content[0]
            message = isinstance(item, OutputMessage)
            out.append(self.events(
                "response.output_text.done" if message else "response.reasoning_text.done",
                item_id=item.id, output_index=index, content_index=0, text=part.text,
                **({"logprobs": []} if message else {})))
            out.append(self.events("response.content_part.done", item_id=item.id,
                                   output_index=index, content_index=0, part=part))
        item.status = status
        return out + [self.events("response.output_item.done", item=item, output_index=index)]


async def stream(gen: Generation, shell: ResponseObject) -> AsyncIterator[str]:
    """response.created and .in_progress, the items' events as tokens come, then
    response.completed (or .incomplete, or .failed where the engine failed the request)."""
    events = _Events()
    yield events("response.created", response=shell)
    yield events("response.in_progress", response=shell)
    items = StreamedItems(gen.prepared, events)
    finish_reason = None
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for _, out in outputs:
                o = out.outputs[0]
                for event in items.feed(o.delta_text, o.finished):
                    yield event
                if o.finished:
                    finish_reason = o.finish_reason
    except APIError as e:
        failed = shell.model_copy(update={"status": "failed", "output": items.items,
                                          "error": ResponseError(code="server_error",
                                                                 message=e.message)})
        yield events("response.failed", response=failed)
        return
    for event in items.finish(finish_reason == "length"):
        yield event
    final = _finished(shell, items.items, finish_reason, gen)
    yield events(f"response.{final.status}", response=final)
