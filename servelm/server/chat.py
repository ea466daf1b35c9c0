"""POST /v1/chat/completions: the chat template, then one engine request with n samples."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from servelm.server.errors import APIError
from servelm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                     ChatLogprobs, ChatResponseMessage, ChatTokenLogprob)
from servelm.server.serving import (SSE_DONE, Generation, Prepared, ServingContext, TokenText,
                                    encode_prompt, new_id, new_logprobs, sampling_params, sse,
                                    structured_outputs)

# SamplingParams / engine names -> this endpoint's request fields, for error params.
_FIELDS = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens", "": "messages",
           **{k: k for k in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "seed", "min_tokens",
                             "stop", "stop_token_ids", "logit_bias")}}


def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    """Render the conversation and tokenise it (in a worker thread: the work grows with the
    request); a bad request raises APIError before anything runs."""
    tok = ctx.engine.tokenizer
    try:
        text = tok.apply_chat_template([m.to_template() for m in req.messages])
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    fields = dict(_FIELDS)
    if req.max_completion_tokens is None:
        fields["max_tokens"] = "max_tokens"
    ids = encode_prompt(ctx, text, fields, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs, fields, structured_outputs(ctx, req))
    return Prepared([(text, ids)], params, fields)


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
    choices = [ChatChoice(index=o.index, message=ChatResponseMessage(content=o.text),
                          logprobs=_logprobs(token_text, o.logprobs) if req.logprobs else None,
                          finish_reason=o.finish_reason)
               for o in out.outputs]
    return ChatCompletionResponse(id=new_id("chatcmpl"), model=ctx.model_name, choices=choices,
                                  usage=gen.usage(), metrics=gen.timings(),
                                  prompt_logprobs=out.prompt_logprobs)


async def stream(ctx: ServingContext, req: ChatCompletionRequest,
                 gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: a role chunk per choice, then one chunk per step with new tokens."""
    token_text = TokenText(ctx.engine.tokenizer)
    base = ChatCompletionChunk(id=new_id("chatcmpl"), model=ctx.model_name, choices=[])

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return base.model_copy(update={"choices": choices})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent = [0] * req.n  # tokens sent per choice
    done = [False] * req.n
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
                    step.append(chunk([ChatChunkChoice(
                        index=o.index, delta=ChatDelta(content=o.delta_text), logprobs=lp,
                        finish_reason=o.finish_reason)]))
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
