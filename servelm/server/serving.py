"""What chat and completions share: sampling params from a request, the engine requests behind
one API request, usage, timings, logprobs and SSE framing."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from pydantic import BaseModel

from servelm.engine.async_engine import (AsyncLLMEngine, EngineDeadError, LoRANotLoadedError,
                                         QueueFullError, RequestStream, ShuttingDownError)
from servelm.outputs import CompletionOutput, RequestOutput
from servelm.sampling_params import SamplingParams
from servelm.server.errors import APIError, from_value_error
from servelm.server.metrics import ServerMetrics
from servelm.server.protocol import (PromptTokensDetails, RequestTimings, SamplingRequest,
                                     TopLogprob, UsageInfo)
from servelm.server.reasoning import ReasoningParser
from servelm.server.tools import HermesParser, ToolParser
from servelm.structured_outputs import StructuredOutputsParams


@dataclass
class ServingContext:
    """What a handler needs: the engine, the metrics, and the name the model is served under."""

    engine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str
    tool_parser: ToolParser = field(default_factory=HermesParser)  # for tool_choice "auto"
    reasoning_parser: ReasoningParser | None = None  # how a thought is told from the answer

    def adapter(self, name: str) -> str | None:
        """The LoRA adapter a request's model field names: None for the served model itself;
        KeyError when it names neither (each API answers that in its own shape)."""
        if name == self.model_name:
            return None
        if name in self.engine.loras:
            return name
        raise KeyError(name)


def new_id(prefix: str) -> str:
    """A response or request id, unique across servers: 'chatcmpl-<32 hex digits>'."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Prepared:
    """A request made ready off the event loop: (text, token ids) per prompt, its sampling
    params, and the engine's field names -> the request's (for error params)."""

    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    fields: dict[str, str]
    tool_parser: ToolParser | None = None  # chat with tools: how its answers are read
    parallel_tool_calls: bool = True
    reasoning_parser: ReasoningParser | None = None  # chat: the thought split from the answer
    lora: str | None = None  # the LoRA adapter it runs with (ServingContext.adapter); None: base


def encode_prompt(ctx: ServingContext, text: str, fields: dict[str, str],
                  add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids; a text too long to fit however it tokenises is refused
    before the (costly) tokenising."""
    tok, max_len = ctx.engine.tokenizer, ctx.engine.engine.max_model_len
    at_least = len(text) // (2 * tok.max_token_chars)  # 2: room for normalisers that shrink
    if at_least >= max_len:
        raise APIError(400, f"prompt is at least {at_least} tokens ({len(text)} characters), "
                            f"but the maximum context length is {max_len} tokens",
                       param=fields.get(""), code="invalid_value")
    return tok.encode(text, add_special_tokens=add_special_tokens)


def structured_outputs(ctx: ServingContext, req: SamplingRequest
                       ) -> StructuredOutputsParams | None:
    """The request's grammar (from response_format, structured_outputs or a guided_* field),
    compiled here (a worker thread) so that the engine finds it cached; a bad one is a 400
    naming the field it came from."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required",
                           param="response_format.json_schema.schema", code="invalid_value")
        found.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object))
                 if v not in (None, False)}
        if len(given) != 1:
            raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, "
                                f"grammar, json_object; got {', '.join(given) or 'none'}",
                           param="structured_outputs", code="invalid_value")
        found.append((f"structured_outputs.{next(iter(given))}", given))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"only one way of constraining the output may be given; got "
                            f"{', '.join(p for p, _ in found)}", param=found[1][0],
                       code="invalid_value")
    param, spec = found[0]
    return compile_structured(ctx, spec, param)


def compile_structured(ctx: ServingContext, spec: dict, param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec), compiled now; a bad one is a 400 naming `param`."""
    try:
        params = StructuredOutputsParams(**spec)
        ctx.engine.engine.grammars.compile(params)
    except ValueError as e:  # GrammarError included
        detail = getattr(e, "detail", str(e))
        raise APIError(400, f"{param}: {detail}", param=param, code="invalid_value") from None
    return params


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    fields: dict[str, str],
                    structured: StructuredOutputsParams | None = None,
                    skip_special_tokens: bool = True) -> SamplingParams:
    """The request's SamplingParams; an invalid combination is a 400 naming the field."""
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            structured_outputs=structured, skip_special_tokens=skip_special_tokens,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None)
    except ValueError as e:
        raise from_value_error(e, fields) from None


class Generation:
    """The engine requests behind one API request (one per prompt), read as one stream.

    close() aborts whatever has not finished (a client that went away) and records the
    request in the metrics exactly once.
    """

    def __init__(self, ctx: ServingContext, prepared: Prepared, cache_salt: str | None = None):
        self.ctx = ctx
        self.prepared = prepared
        prompts, params, fields = prepared.prompts, prepared.params, prepared.fields
        self.prompt_lens = [len(ids) for _, ids in prompts]
        # The name answers carry: the adapter's, or the served model's.
        self.model = prepared.lora or ctx.model_name
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        self.streams: list[RequestStream] = []
        self._closed = False
        base = new_id("req")
        try:
            ctx.engine.check_fits(len(prompts), params.n)  # a retry could never succeed: 400
            for i, (text, ids) in enumerate(prompts):
                self.streams.append(ctx.engine.generate(text, params, f"{base}-{i}",
                                                        prompt_token_ids=ids,
                                                        cache_salt=cache_salt,
                                                        lora_request=prepared.lora))
        except (ValueError, QueueFullError, EngineDeadError) as e:
            self._closed = True  # refused: nothing to record
            for s in self.streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), code="queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, ShuttingDownError):
                raise APIError(503, str(e), code="server_shutting_down") from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_unavailable") from None
            raise from_value_error(e, fields) from None

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.last)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as each engine step reports them, across all prompts."""
        reads = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(self.streams)}
        try:
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = reads.pop(fut)
                    try:
                        out = fut.result()
                    except StopAsyncIteration:
                        continue
                    except ShuttingDownError as e:  # past the drain time
                        raise APIError(503, f"{e}: the request did not finish within the "
                                            f"shutdown timeout", code="server_shutting_down") from e
                    except LoRANotLoadedError as e:  # unloaded since the model was checked
                        raise APIError(404, str(e), param="model",
                                       code="model_not_found") from e
                    except Exception as e:  # the engine failed this request
                        raise APIError(500, f"generation failed: {e}", code="engine_error") from e
                    self.last[i] = out
                    if not out.finished:
                        reads[asyncio.ensure_future(self.streams[i].__anext__())] = i
                    yield i, out
        finally:
            for fut in reads:
                fut.cancel()
            self.close()

    async def run(self) -> list[RequestOutput]:
        """Wait for every prompt to finish; the final outputs in prompt order."""
        async for _ in self.outputs():
            pass
        return self.last

    def close(self) -> None:
        for s in self.streams:
            s.abort()
        if not self._closed:
            self._closed = True
            self.ctx.metrics.record(self.prompt_lens, self.last, self.finished)

    def usage(self) -> UsageInfo:
        """Prompt tokens once per prompt; completion tokens summed over every sample."""
        prompt = sum(self.prompt_lens)
        completion = sum(len(o.token_ids) for out in self.last if out for o in out.outputs)
        # Each prompt's first sample says how much of it came from the prefix cache.
        cached = sum(out.outputs[0].metrics.num_cached_tokens for out in self.last
                     if out and out.outputs and out.outputs[0].metrics)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def timings(self) -> RequestTimings:
        """Request-level timings: first queue exit and first token, last finish, mean TPOT."""
        ms = [o.metrics for out in self.last if out for o in out.outputs if o.metrics]

        def pick(values, fn):
            values = [v for v in values if v is not None]
            return fn(values) if values else None

        return RequestTimings(
            ttft_s=pick((m.ttft for m in ms), min),
            tpot_s=pick((m.tpot for m in ms), lambda v: sum(v) / len(v)),
            queue_time_s=pick((m.queue_time for m in ms), min),
            e2e_s=pick((m.e2e_latency for m in ms), max))


class TokenText:
    """Token id -> its text and bytes, for logprobs."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __call__(self, token_id: int) -> str:
        return self._tok.token_text(token_id)

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self(token_id)
        # A token holding part of a UTF-8 character decodes to U+FFFD; its bytes are approximate.
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def new_logprobs(sample: CompletionOutput, num_sent: int) -> list:
    """The sample's TokenLogprobs not yet sent (the engine's list is cumulative)."""
    return list(sample.logprobs[num_sent:]) if sample.logprobs is not None else []


def sse(chunk: BaseModel | dict) -> str:
    """One server-sent event; usage and metrics appear only on the chunks that carry them."""
    if isinstance(chunk, BaseModel):
        drop = {k for k in ("usage", "metrics") if getattr(chunk, k, 0) is None}
        return f"data: {chunk.model_dump_json(exclude=drop)}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
