"""POST /v1/chat/completions: the chat template, then one engine request with n samples."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator

from servelm.server.errors import APIError
from servelm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                     ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                                     DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                     NamedToolChoice, ToolCall)
from servelm.server.reasoning import ReasoningParser, ReasoningStream
from servelm.server.serving import (SSE_DONE, Generation, Prepared, ServingContext, TokenText,
                                    compile_structured, encode_prompt, new_id, new_logprobs,
                                    sampling_params, sse, structured_outputs)
from servelm.server.tools import (ArrayCallsParser, NamedCallParser, ToolCallStream, ToolParser,
                                  forced_schema, tool_system_prompt)
from servelm.structured_outputs import StructuredOutputsParams

# SamplingParams / engine names -> this endpoint's request fields, for error params.
_FIELDS = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens", "": "messages",
           **{k: k for k in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "seed", "min_tokens",
                             "stop", "stop_token_ids", "logit_bias")}}


def request_tools(req: ChatCompletionRequest) -> tuple[str | object, list[dict] | None]:
    """The request's tool_choice (defaulted) and the tools the template sees (none for
    tool_choice "none")."""
    choice = req.tool_choice or ("auto" if req.tools else "none")
    tools = ([t.model_dump(exclude_none=True) for t in req.tools]
             if req.tools and choice != "none" else None)
    return choice, tools


def render(tok, req: ChatCompletionRequest, tools: list[dict] | None) -> str:
    """The conversation as the chat template renders it (the tools written into the messages
    for a template that does not render tools); ValueError from the template. A router
    in front computes the same text (servelm.router.prompts)."""
    messages = [m.to_template() for m in req.messages]
    if not tok.renders_tools and (tools or any(m.get("tool_calls") for m in messages)):
        # (with tool_choice "none" too: earlier calls in the history still need writing out)
        messages = describe_tools(messages, tools)
    return tok.apply_chat_template(messages, tools=tools, chat_template=req.chat_template,
                                   template_kwargs=req.template_kwargs())


def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    """Render the conversation and tokenise it (in a worker thread: the work grows with the
    request); a bad request raises APIError before anything runs."""
    choice, tools = request_tools(req)
    try:
        text = render(ctx.engine.tokenizer, req, tools)
    except ValueError as e:
        param = "chat_template" if req.chat_template else "messages"
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    fields = dict(_FIELDS)
    if req.max_completion_tokens is None:
        fields["max_tokens"] = "max_tokens"
    ids = encode_prompt(ctx, text, fields, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured = structured_outputs(ctx, req)
    reasoning = ctx.reasoning_parser.for_prompt(text) if ctx.reasoning_parser else None
    parallel = req.parallel_tool_calls is not False
    parser: ToolParser | None = (ctx.tool_parser.for_tools([t["function"]["name"]
                                                             for t in tools])
                                  if tools else None)
    if choice == "required" or isinstance(choice, NamedToolChoice):
        # The answer is forced into the tools' schemas by a grammar: any model can do it.
        if structured is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined "
                                "with response_format or structured outputs",
                           param="tool_choice", code="invalid_value")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        schema = forced_schema([t["function"] for t in tools], named, parallel)
        structured = compile_structured(ctx, {"json": schema}, "tools")
        parser = NamedCallParser(named) if named else ArrayCallsParser()
        if reasoning is not None:
            structured = _behind_thought(ctx, reasoning, structured, "tool_choice")
    elif structured is not None and reasoning is not None:
        structured = _behind_thought(ctx, reasoning, structured, _structured_param(req))
    # Special tokens stay in the text where a parser reads them (a tool call's opening
    # control token, harmony's message tags).
    skip = ((parser.skip_special_tokens if parser else True)
            and (reasoning.skip_special_tokens if reasoning else True))
    params = sampling_params(req, max_tokens, logprobs, fields, structured,
                             skip_special_tokens=skip)
    return Prepared([(text, ids)], params, fields, parser, parallel, reasoning)


def _structured_param(req: ChatCompletionRequest) -> str:
    """The field a (single, already checked) structured-outputs constraint came from."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    if req.structured_outputs is not None:
        return "structured_outputs"
    return next(f"guided_{k}" for k in ("json", "regex", "choice", "grammar")
                if getattr(req, f"guided_{k}") is not None)


def _behind_thought(ctx: ServingContext, reasoning: ReasoningParser,
                    structured: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """A reasoning model's constraint applies to the answer after its thought."""
    try:
        spec = reasoning.answer_grammar(structured)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    return compile_structured(ctx, {"grammar": spec.grammar}, param)


def describe_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that does not render tools: the tools described in the system message
    (none: tool_choice "none"), and earlier calls written into their assistant turns in the
    format asked for there."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "".join(
                "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"])
            m = {"role": m["role"], "content": ((m.get("content") or "") + calls).strip()}
        out.append(m)
    if not tools:
        return out
    prompt = tool_system_prompt(tools)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _message(prepared: Prepared, text: str, finish_reason: str | None
             ) -> tuple[ChatResponseMessage, str | None]:
    """The answer as a message: its thought (a reasoning model's), then its tool calls (when
    the request had tools, read from the answer after the thought only) and content."""
    thought = None
    if prepared.reasoning_parser is not None:
        thought, text = prepared.reasoning_parser.split(text)
    parser = prepared.tool_parser
    if parser is None:
        return _with_thought(text, thought), finish_reason
    parsed = parser.parse(text, final=True)
    calls = [c for c in parsed.calls if c.name is not None]
    if not prepared.parallel_tool_calls:
        calls = calls[:1]
    if not calls:
        return _with_thought(parsed.content, thought), finish_reason
    tool_calls = [ToolCall(id=parser.new_call_id(),
                           function=FunctionCall(name=c.name, arguments=c.arguments or ""))
                  for c in calls]
    message = _with_thought(parsed.content or None, thought)
    return (message.model_copy(update={"tool_calls": tool_calls}),
            "tool_calls" if finish_reason == "stop" else finish_reason)


def _with_thought(content: str | None, thought: str | None) -> ChatResponseMessage:
    """A message with its thought under both names; an answer that is only a thought has
    no content (None, as vLLM sends it)."""
    if thought is None:
        return ChatResponseMessage(content=content)
    return ChatResponseMessage(content=content or None, reasoning_content=thought,
                               reasoning=thought)


def _logprobs(token_text: TokenText, entries: list) -> ChatLogprobs:
    content = []
    for e in entries:
        top = token_text.top(e.token_id, e.logprob)
        content.append(ChatTokenLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes,
                                        top_logprobs=[token_text.top(t, lp) for t, lp in e.top]))
    return ChatLogprobs(content=content)


async def complete(ctx: ServingContext, req: ChatCompletionRequest,
                   gen: Generation) -> ChatCompletionResponse:
    """Run to the end and answer in one response."""
    (out,) = await gen.run()
    token_text = TokenText(ctx.engine.tokenizer)
    choices = []
    for o in out.outputs:
        message, finish_reason = _message(gen.prepared, o.text, o.finish_reason)
        choices.append(ChatChoice(
            index=o.index, message=message, finish_reason=finish_reason,
            logprobs=_logprobs(token_text, o.logprobs) if req.logprobs else None))
    return ChatCompletionResponse(id=new_id("chatcmpl"), model=gen.model, choices=choices,
                                  usage=gen.usage(), metrics=gen.timings(),
                                  prompt_logprobs=out.prompt_logprobs)


async def stream(ctx: ServingContext, req: ChatCompletionRequest,
                 gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: a role chunk per choice, then one chunk per step with new tokens
    (a reasoning model's: the thought's text and the answer's apart)."""
    token_text = TokenText(ctx.engine.tokenizer)
    base = ChatCompletionChunk(id=new_id("chatcmpl"), model=gen.model, choices=[])

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return base.model_copy(update={"choices": choices})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent = [0] * req.n  # tokens sent per choice
    done = [False] * req.n
    parser = gen.prepared.tool_parser
    calls = ([ToolCallStream(parser, gen.prepared.parallel_tool_calls) for _ in range(req.n)]
             if parser is not None else None)
    reasoning = gen.prepared.reasoning_parser
    thoughts = ([_Thought(reasoning.stream()) for _ in range(req.n)]
                if reasoning is not None else None)
    for i in range(req.n):
        yield sse(chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for _, out in outputs:
                step = []
                for o in out.outputs:
                    if done[o.index] or (not o.delta_token_ids and not o.finished):
                        continue
                    lp = None
                    if req.logprobs:
                        lp = _logprobs(token_text, new_logprobs(o, sent[o.index]))
                    sent[o.index] = len(o.token_ids)
                    done[o.index] = o.finished
                    text, thought = o.text, None
                    delta, finish_reason = ChatDelta(content=o.delta_text), o.finish_reason
                    if thoughts is not None:
                        thought, answer = thoughts[o.index].feed(o.delta_text, o.finished)
                        text = thoughts[o.index].answer
                        delta = ChatDelta(content=answer or None)
                    if calls is not None:
                        delta, finish_reason = _tool_delta(calls[o.index], text, finish_reason)
                    if thought:
                        delta = delta.model_copy(update={"reasoning_content": thought,
                                                         "reasoning": thought})
                    if ((calls is not None or thoughts is not None)
                            and not (delta.content or delta.tool_calls or thought or lp
                                     or o.finished)):
                        continue  # held back: it may turn out to be a call or a tag
                    step.append(chunk([ChatChunkChoice(
                        index=o.index, delta=delta, logprobs=lp, finish_reason=finish_reason)]))
                if out.finished:
                    if include_usage:
                        step.append(chunk([]).model_copy(update={"usage": gen.usage()}))
                    step = step or [chunk([])]
                    step[-1] = step[-1].model_copy(update={"metrics": gen.timings()})
                for c in step:
                    yield sse(c)
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


class _Thought:
    """One choice's stream through the reasoning parser: the thought's and the answer's new
    text each step, and the answer so far (what a tool parser reads)."""

    def __init__(self, stream: ReasoningStream):
        self._stream = stream
        self.answer = ""

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        thought, answer = self._stream.feed(delta, final)
        self.answer += answer
        return thought, answer


def _tool_delta(calls: ToolCallStream, text: str, finish_reason: str | None
                ) -> tuple[ChatDelta, str | None]:
    """This step's delta of a choice whose text may hold tool calls."""
    content, pieces = calls.feed(text, final=finish_reason is not None)
    tool_calls = [DeltaToolCall(index=p.index, id=p.id, type="function" if p.id else None,
                                function=DeltaFunctionCall(name=p.name,
                                                           arguments=p.arguments or
                                                           ("" if p.id else None)))
                  for p in pieces] or None
    if calls.called and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatDelta(content=content or None, tool_calls=tool_calls), finish_reason
