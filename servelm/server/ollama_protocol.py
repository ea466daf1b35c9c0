"""Ollama's native request bodies (/api/chat, /api/generate, /api/show, /api/embed) and their
mapping onto servelm's internal requests (ChatCompletionRequest, CompletionRequest).

As protocol.py does for OpenAI's fields, each Ollama field is honoured, accepted without
effect on the output (load-time and placement options, keep_alive: servelm keeps one model
loaded), or refused with a 400 naming it (what would change the output if ignored: images,
a Go template, fill-in-the-middle suffix, samplers servelm does not run)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from servelm.server.protocol import Int, ToolDefinition, _Request, no_suffix

# Ollama's own defaults for what a request leaves out (api.DefaultOptions); penalties stay
# off, since servelm cannot limit them to the last repeat_last_n (64) tokens as Ollama does.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
MAX_TOP_LOGPROBS = 20  # Ollama's limit

# servelm's request fields -> Ollama's, for the errors the internal request raises.
FIELD_NAMES = {"max_completion_tokens": "options.num_predict", "max_tokens": "options.num_predict",
               "repetition_penalty": "options.repeat_penalty", "response_format": "format",
               "response_format.json_schema.schema": "format",
               **{k: f"options.{k}" for k in ("temperature", "top_k", "top_p", "min_p", "seed",
                                               "stop", "presence_penalty", "frequency_penalty")}}


def _no_images(v: list | None, where: str) -> list | None:
    if v:
        raise ValueError(f"'{where}' is not supported: servelm serves text-only models "
                         f"(no vision encoder), so images cannot be read")
    return v


class Options(_Request):
    """`options`: the Modelfile parameters a request may set."""

    # honoured
    num_predict: Int | None = None   # -1 (or -2): until the context is full
    num_ctx: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_k: Int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int | None = None          # -1: a random one
    stop: list[str] | str | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # Accepted without effect on the output: how and where the model is loaded and run, and
    # num_keep, which only matters for a context shift (servelm never shifts: a request that
    # would not fit is refused, one that reaches the context's end stops with "length").
    numa: bool | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: Int | None = None
    num_keep: Int | None = None
    # Only at their neutral values (servelm does not run these samplers).
    repeat_last_n: Int | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: Int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v: int | None) -> int | None:
        if v is not None and v < 1 and v not in (-1, -2):
            raise ValueError("num_predict must be a positive number of tokens, or -1 (or -2) "
                             "for 'until the context is full'")
        return v

    @field_validator("typical_p", "tfs_z", "mirostat")
    @classmethod
    def _neutral(cls, v: float | None, info: ValidationInfo) -> float | None:
        neutral = 0 if info.field_name == "mirostat" else 1.0
        if v is not None and v != neutral:
            raise ValueError(f"{info.field_name} {v} is not supported by servelm (only "
                             f"{neutral}, which turns it off)")
        return v

    @field_validator("repeat_last_n", "penalize_newline")
    @classmethod
    def _whole_context(cls, v: Any, info: ValidationInfo) -> Any:
        """servelm's penalties apply to every earlier token, newlines included."""
        penalised = any(info.data.get(k) not in (None, n) for k, n in (
            ("repeat_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)))
        whole = v is True if info.field_name == "penalize_newline" else v == -1
        if penalised and v is not None and not whole:
            raise ValueError(f"{info.field_name} {v} is not supported by servelm with a "
                             f"penalty: its penalties look at every earlier token "
                             f"(repeat_last_n -1, penalize_newline true)")
        return v

    def max_tokens(self) -> int | None:
        """The output limit asked for; None: until the context is full."""
        return self.num_predict if self.num_predict and self.num_predict > 0 else None

    def sampling(self) -> dict[str, Any]:
        """The internal request's sampling fields (Ollama's defaults for what is unset)."""
        out: dict[str, Any] = dict(DEFAULTS)
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.repeat_penalty is not None:
            out["repetition_penalty"] = self.repeat_penalty
        if self.seed is not None and self.seed >= 0:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return out


class ToolCallFunction(_Request):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # an object (or its JSON)
    index: Int | None = None


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(_Request):
    """One turn of /api/chat's messages."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None   # an earlier answer's reasoning: not rendered again
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None      # a tool turn: the function that gave this result
    tool_call_id: str | None = None   # ... or the call it answers

    @field_validator("images")
    @classmethod
    def _text_only(cls, v: list | None) -> list | None:
        return _no_images(v, "images")


Format = Literal["", "json"] | dict[str, Any] | None


class _Generating(_Request):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    format: Format = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: float | int | str | None = None  # accepted: the model stays loaded anyway
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted: a prompt over the context is refused (400) rather than truncated, and
    # generation stops at the context's end ("length") rather than shifting it.
    truncate: bool | None = None
    shift: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        return v

    def response_format(self) -> dict | None:
        """`format` as the internal request's response_format."""
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "format",
                                                            "schema": self.format}}
        return None

    def internal(self) -> dict[str, Any]:
        """The internal request's fields shared by chat and completions (messages or prompt,
        and the output limit, are the caller's)."""
        fields = {**self.options.sampling(), "response_format": self.response_format()}
        return {k: v for k, v in fields.items() if v is not None}


class ChatRequest(_Generating):
    """Body of POST /api/chat; no messages: a load request (answered at once)."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[ToolDefinition] | None = None


class GenerateRequest(_Generating):
    """Body of POST /api/generate; an empty prompt: a load request (answered at once)."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[Int] | None = None  # an earlier answer's context: its tokens come first
    # Refused when set: see the validators.
    suffix: str | None = None
    template: str | None = None
    images: list[Any] | None = None
    width: Int | None = None
    height: Int | None = None
    steps: Int | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, v: list | None) -> list | None:
        return _no_images(v, "images")

    _no_suffix = field_validator("suffix")(no_suffix)

    @field_validator("template")
    @classmethod
    def _no_template(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("'template' is not supported by servelm: prompts are rendered by "
                             "the model's Jinja chat template (Ollama's are Go templates); send "
                             "a fully formatted prompt with 'raw': true instead")
        return v

    @field_validator("width", "height", "steps")
    @classmethod
    def _no_images_out(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None:
            raise ValueError(f"'{info.field_name}' is not supported: servelm serves language "
                             f"models, not image generators")
        return v

    @model_validator(mode="after")
    def _raw_alone(self) -> "GenerateRequest":
        if self.raw and (self.system or self.context):
            raise ValueError("raw mode does not support template, system, or context")
        return self


class ShowRequest(_Request):
    """Body of POST /api/show (`name`: the older spelling of `model`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None


class EmbedRequest(_Request):
    """Body of POST /api/embed."""

    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: bool | None = None
    dimensions: Int | None = Field(None, ge=1)
    options: Options = Field(default_factory=Options)
    keep_alive: float | int | str | None = None

    def inputs(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return self.input


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's turns as the internal request's: tool calls get ids (Ollama's history may
    carry none) and each tool turn the id of the call it answers (its tool_call_id, else the
    first unanswered call of its tool_name, else the first unanswered call)."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name)
    made = 0
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                made += 1
                call_id = c.id or f"call_{made}"
                args = c.function.arguments
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
                unanswered.append((call_id, c.function.name))
            turn["tool_calls"] = calls
            turn["content"] = m.content or None
        if m.role == "tool":
            turn["tool_call_id"] = _answered(m, unanswered, made)
            if m.tool_name:
                turn["name"] = m.tool_name
        out.append(turn)
    return out


def _answered(m: Message, unanswered: list[tuple[str, str]], made: int) -> str:
    pick = next((c for c in unanswered if c[0] == m.tool_call_id), None)
    if pick is None and m.tool_call_id is None:
        pick = next((c for c in unanswered if c[1] == m.tool_name), None)
        if pick is None and unanswered:
            pick = unanswered[0]
    if pick is None:
        return m.tool_call_id or f"call_{made + 1}_result"
    unanswered.remove(pick)
    return pick[0]
