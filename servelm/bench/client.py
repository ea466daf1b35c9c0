"""One streamed request to an OpenAI-compatible endpoint, timed from the client side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from servelm.bench.datasets import BenchPrompt


@dataclass
class RequestRecord:
    """What one request did, as the client saw it. Times in seconds (perf_counter clock).

    output_tokens comes from the server's usage chunk when it sends one, else the number of
    content chunks. itl holds one entry per token after the first; a chunk that carries k
    tokens (known only from per-chunk usage) adds k entries of gap/k.
    """

    index: int
    output_len: int
    success: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def endpoint_kind(endpoint: str) -> str:
    """'chat' or 'completions' from the endpoint path; ValueError for anything else."""
    path = endpoint.rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    raise ValueError(f"endpoint must end in /completions or /chat/completions, got {endpoint!r}")


def build_payload(kind: str, model: str | None, prompt: str | list[int], max_tokens: int,
                  temperature: float, ignore_eos: bool = True,
                  stream: bool = True) -> dict[str, Any]:
    """The request body for one prompt: streamed, or (stream=False) answered whole, which
    times the answer as one chunk (TTFT = end-to-end latency)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        # Not in OpenAI's spec but honoured by vLLM, SGLang, servelm: without it the output
        # length, and so the load, depends on when the model happens to stop.
        body["ignore_eos"] = True
    if kind == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


_DONE = object()


def parse_sse_line(line: str) -> Any:
    """The JSON payload of one SSE 'data:' line, _DONE for [DONE], None for anything else."""
    if not line.startswith("data:"):
        return None  # blank separators, ': keep-alive' comments, 'event:' lines
    data = line[5:].strip()
    if not data:
        return None
    if data == "[DONE]":
        return _DONE
    return json.loads(data)


TOKEN, CLOSING = "token", "closing"


def classify_chunk(chunk: dict[str, Any]) -> str | None:
    """TOKEN if a streamed chunk (completions or chat) delivers generated tokens, CLOSING if
    it is an empty one carrying finish_reason, None for anything else.

    Empty text is still a TOKEN: servers (servelm, vLLM) send a chunk per step even while the
    detokenizer holds back the bytes of an incomplete character. A CLOSING chunk may hold the
    last token or nothing at all; only the usage count can tell (TokenTimer.finish).
    Never tokens: usage-only chunks and chat's role-only opener.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "delta" in c:
        delta = c.get("delta") or {}
        text = delta.get("content")
        if delta.get("role") and not text:
            return None
    else:
        text = c.get("text")
    if text:
        return TOKEN
    if c.get("finish_reason") is not None:
        return CLOSING
    return TOKEN if text is not None else None


class TokenTimer:
    """Fills a record's TTFT and inter-token gaps as content chunks arrive (call content())."""

    def __init__(self, rec: RequestRecord):
        self.rec = rec
        self.last: float | None = None
        self.chunks = 0
        self.usage_tokens: int | None = None  # cumulative completion_tokens, per-chunk usage
        self.closing_at: tuple[float, dict | None] | None = None

    def content(self, now: float, usage: dict | None) -> None:
        """A chunk with generated text arrived at perf_counter time now, with its usage if any."""
        tokens = 1
        count = usage.get("completion_tokens") if usage else None
        # Usage from the first content chunk on means the server reports it per chunk, so
        # each delta says how many tokens that chunk held. Usage first seen on a later chunk
        # is a final total and says nothing about that chunk alone.
        if count is not None and (self.chunks == 0 or self.usage_tokens is not None):
            tokens = max(1, int(count) - (self.usage_tokens or 0))
            self.usage_tokens = int(count)
        if self.last is None:
            self.rec.ttft = now - self.rec.start
        else:
            gap = now - self.last
            self.rec.itl.extend([gap / tokens] * tokens)
        self.last = now
        self.chunks += 1

    def closing(self, now: float, usage: dict | None) -> None:
        """An empty chunk with finish_reason arrived: a token or not, as finish() decides."""
        self.closing_at = (now, usage)

    def finish(self, completion_tokens: int | None) -> None:
        """End of stream: count the closing chunk if usage shows a token still unaccounted."""
        counted = self.chunks if self.usage_tokens is None else self.usage_tokens
        if (self.closing_at is not None and completion_tokens is not None
                and counted < completion_tokens):
            self.content(*self.closing_at)


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                       index: int, prompt: BenchPrompt,
                       headers: dict[str, str] | None = None) -> RequestRecord:
    """POST one streaming request and time it; never raises for request-level failures."""
    rec = RequestRecord(index=index, output_len=prompt.output_len, prompt_tokens=prompt.input_len)
    timer = TokenTimer(rec)
    rec.start = time.perf_counter()
    try:
        return await _stream(client, url, payload, headers, rec, timer)
    finally:
        if rec.e2e is None:  # failures too: when they failed shows in the JSON records
            rec.e2e = time.perf_counter() - rec.start


async def _stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                  headers: dict[str, str] | None, rec: RequestRecord,
                  timer: TokenTimer) -> RequestRecord:
    usage: dict | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return rec
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                # A server that ignored stream=true: the whole answer is one "chunk".
                chunk = json.loads(await resp.aread())
                usage = chunk.get("usage")
                if _full_text(chunk):
                    timer.content(time.perf_counter(), None)
            else:
                async for line in resp.aiter_lines():
                    data = parse_sse_line(line)
                    if data is _DONE:
                        break
                    if data is None:
                        continue
                    if "error" in data and not data.get("choices"):
                        rec.error = f"stream error: {_error_message(json.dumps(data))}"
                        return rec
                    if data.get("usage"):
                        usage = data["usage"]
                    kind = classify_chunk(data)
                    if kind == TOKEN:
                        timer.content(time.perf_counter(), data.get("usage"))
                    elif kind == CLOSING:
                        timer.closing(time.perf_counter(), data.get("usage"))
        rec.e2e = time.perf_counter() - rec.start
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return rec
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # malformed JSON or chunk
        rec.error = f"bad response: {e}"
        return rec
    total = usage.get("completion_tokens") if usage else None
    timer.finish(total)
    if usage:
        rec.output_tokens = int(total or timer.chunks)
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])
    else:
        rec.output_tokens = timer.chunks
    if timer.chunks == 0:
        rec.error = "no content tokens in the response"
        return rec
    rec.success = True
    return rec


def _full_text(body: dict[str, Any]) -> str:
    choices = body.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("message") or {}).get("content") or c.get("text") or ""


def _error_message(body: str) -> str:
    """The 'message' of an OpenAI-style error body, else the body itself, on one short line."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg is None and isinstance(obj, dict):
            msg = obj.get("detail", body)
        text = str(msg)
    except (ValueError, AttributeError):
        text = body
    text = " ".join(text.split())
    return text[:200] + ("..." if len(text) > 200 else "")
