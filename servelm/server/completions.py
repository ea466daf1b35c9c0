"""POST /v1/completions: one engine request per prompt, n samples each.

Choice indexes follow OpenAI: prompt p's sample j is choice p * n + j. With echo, each
choice's text starts with its prompt (streamed: in its first chunk), and with logprobs the
prompt's tokens' logprobs come first (the first token's is None); max_tokens 0 with echo
scores the prompt and generates nothing (one token is sampled and dropped, as vLLM does).
"""

from __future__ import annotations

import dataclasses
from contextlib import aclosing
from typing import AsyncIterator

from servelm.server.errors import APIError
from servelm.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                     CompletionRequest, CompletionResponse,
                                     CompletionResponseChoice)
from servelm.server.serving import (SSE_DONE, Generation, Prepared, ServingContext, TokenText,
                                    encode_prompt, new_id, new_logprobs, sampling_params, sse,
                                    structured_outputs)

_FIELDS = {"": "prompt", **{k: k for k in (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "logit_bias", "logprobs", "prompt_logprobs")}}


def prepare(ctx: ServingContext, req: CompletionRequest) -> Prepared:
    """Tokenise every prompt (in a worker thread); a bad request raises APIError before
    anything runs."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "'max_tokens' 0 is only allowed with 'echo' true (the prompt "
                            "scored, nothing generated)", param="max_tokens", code="invalid_value")
    prompts = [(p, encode_prompt(ctx, p, _FIELDS)) if isinstance(p, str) else (None, p)
               for p in req.prompt]
    params = sampling_params(req, req.max_tokens or 1, req.logprobs, _FIELDS,
                             structured_outputs(ctx, req))
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        # The echoed prompt's logprobs: as many alternatives as the output's (vLLM's rule).
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    if req.echo:  # the text to prepend: the prompt as sent, or its ids decoded
        prompts = [(text if text is not None else ctx.engine.tokenizer.decode(ids), ids)
                   for text, ids in prompts]
    return Prepared(prompts, params, _FIELDS)


def _echo_logprobs(token_text: TokenText, ids: list[int], prompt_logprobs: list | None
                   ) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: each prompt token scored by the
    positions before it (the first by none), its top entries the alternatives there."""
    tokens = [token_text(t) for t in ids]
    plp = prompt_logprobs or [None] * len(ids)
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else e[t].logprob for t, e in zip(ids, plp)],
        top_logprobs=[None if e is None else {token_text(k): v.logprob for k, v in e.items()}
                      for e in plp],
        text_offset=offsets)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def _offset_after(lp: CompletionLogprobs, default: int = 0) -> int:
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else default


def _logprobs(token_text: TokenText, entries: list, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape; text_offset counts from the start of the choice's text. Each
    top_logprobs entry holds the top `logprobs` tokens and always the sampled one (so up to
    logprobs + 1 entries; logprobs=0: the sampled token alone)."""
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{**{token_text(t): lp for t, lp in e.top}, tok: e.logprob}
                      for tok, e in zip(tokens, entries)],
        text_offset=offsets)


async def complete(ctx: ServingContext, req: CompletionRequest,
                   gen: Generation) -> CompletionResponse:
    """Run every prompt to the end and answer in one response."""
    outs = await gen.run()
    token_text = TokenText(ctx.engine.tokenizer)
    generate = req.max_tokens != 0
    choices = []
    for p, out in enumerate(outs):
        echo = (out.prompt or "") if req.echo else ""
        for o in out.outputs:
            lp = None
            if req.logprobs is not None:
                head = (_echo_logprobs(token_text, out.prompt_token_ids, out.prompt_logprobs)
                        if req.echo else None)
                lp = _logprobs(token_text, o.logprobs if generate else [],
                               _offset_after(head) if head else 0)
                lp = _joined(head, lp) if head else lp
            choices.append(CompletionResponseChoice(
                index=p * req.n + o.index, text=echo + (o.text if generate else ""), logprobs=lp,
                finish_reason=o.finish_reason, prompt_logprobs=(
                    out.prompt_logprobs if req.prompt_logprobs is not None else None)))
    usage = gen.usage()
    if not generate:  # the one token sampled to finish the request is not an output
        usage = usage.model_copy(update={"completion_tokens": 0,
                                         "total_tokens": usage.prompt_tokens})
    return CompletionResponse(id=new_id("cmpl"), model=gen.model, choices=choices,
                              usage=usage, metrics=gen.timings())


async def stream(ctx: ServingContext, req: CompletionRequest,
                 gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice per step that produced tokens."""
    token_text = TokenText(ctx.engine.tokenizer)
    base = CompletionChunk(id=new_id("cmpl"), model=gen.model, choices=[])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    num_choices = len(req.prompt) * req.n
    sent = [0] * num_choices     # tokens sent per choice
    offset = [0] * num_choices   # text_offset of the next token per choice
    done = [False] * num_choices
    generate = req.max_tokens != 0
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for p, out in outputs:
                step = []
                for o in out.outputs:
                    c = p * req.n + o.index
                    if done[c] or (not o.delta_token_ids and not o.finished):
                        continue
                    first = sent[c] == 0
                    text = o.delta_text if generate else ""
                    lp = None
                    if req.logprobs is not None:
                        if first and req.echo:  # the prompt's part comes first
                            head = _echo_logprobs(token_text, out.prompt_token_ids,
                                                  out.prompt_logprobs)
                            offset[c] = _offset_after(head)
                        lp = _logprobs(token_text, new_logprobs(o, sent[c]) if generate else [],
                                       offset[c])
                        offset[c] = _offset_after(lp, offset[c])
                        if first and req.echo:
                            lp = _joined(head, lp)
                    if first and req.echo:
                        text = (out.prompt or "") + text
                    sent[c] = len(o.token_ids)
                    done[c] = o.finished
                    step.append(base.model_copy(update={"choices": [CompletionChoice(
                        index=c, text=text, logprobs=lp, finish_reason=o.finish_reason)]}))
                if gen.finished:
                    if include_usage:
                        usage = gen.usage()
                        if not generate:
                            usage = usage.model_copy(update={
                                "completion_tokens": 0, "total_tokens": usage.prompt_tokens})
                        step.append(base.model_copy(update={"usage": usage}))
                    step = step or [base]
                    step[-1] = step[-1].model_copy(update={"metrics": gen.timings()})
                for c in step:
                    yield sse(c)
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
