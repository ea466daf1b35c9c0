"""POST /v1/completions: one engine request per prompt, n samples each.

Choice indexes follow OpenAI: prompt p's sample j is choice p * n + j.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from servelm.server.errors import APIError
from servelm.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                     CompletionRequest, CompletionResponse)
from servelm.server.serving import (SSE_DONE, Generation, Prepared, ServingContext, TokenText,
                                    encode_prompt, new_id, new_logprobs, sampling_params, sse,
                                    structured_outputs)

_FIELDS = {"": "prompt", **{k: k for k in (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
    "logit_bias", "logprobs")}}


def prepare(ctx: ServingContext, req: CompletionRequest) -> Prepared:
    """Tokenise every prompt (in a worker thread); a bad request raises APIError before
    anything runs."""
    prompts = [(p, encode_prompt(ctx, p, _FIELDS)) if isinstance(p, str) else (None, p)
               for p in req.prompt]
    params = sampling_params(req, req.max_tokens, req.logprobs, _FIELDS,
                             structured_outputs(ctx, req))
    return Prepared(prompts, params, _FIELDS)


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
    choices = []
    for p, out in enumerate(outs):
        for o in out.outputs:
            lp = _logprobs(token_text, o.logprobs, 0) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=p * req.n + o.index, text=o.text, logprobs=lp,
                                            finish_reason=o.finish_reason))
    return CompletionResponse(id=new_id("cmpl"), model=ctx.model_name, choices=choices,
                              usage=gen.usage(), metrics=gen.timings())


async def stream(ctx: ServingContext, req: CompletionRequest,
                 gen: Generation) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice per step that produced tokens."""
    token_text = TokenText(ctx.engine.tokenizer)
    base = CompletionChunk(id=new_id("cmpl"), model=ctx.model_name, choices=[])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    num_choices = len(req.prompt) * req.n
    sent = [0] * num_choices     # tokens sent per choice
    offset = [0] * num_choices   # text_offset of the next token per choice
    done = [False] * num_choices
    try:
        async with aclosing(gen.outputs()) as outputs:
            async for p, out in outputs:
                step = []
                for o in out.outputs:
                    c = p * req.n + o.index
                    if done[c] or (not o.delta_token_ids and not o.finished):
                        continue
                    lp = None
                    if req.logprobs is not None:
                        lp = _logprobs(token_text, new_logprobs(o, sent[c]), offset[c])
                        if lp.tokens:
                            offset[c] = lp.text_offset[-1] + len(lp.tokens[-1])
                    sent[c] = len(o.token_ids)
                    done[c] = o.finished
                    step.append(base.model_copy(update={"choices": [CompletionChoice(
                        index=c, text=o.delta_text, logprobs=lp, finish_reason=o.finish_reason)]}))
                if gen.finished:
                    if include_usage:
                        step.append(base.model_copy(update={"usage": gen.usage()}))
                    step = step or [base]
                    step[-1] = step[-1].model_copy(update={"metrics": gen.timings()})
                for c in step:
                    yield sse(c)
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
