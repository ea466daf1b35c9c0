"""Pydantic schemas of the OpenAI-compatible API: requests (strict) and responses.

Requests forbid unknown fields. The fields clients send fall in three kinds: those servelm
honours; those that only carry metadata or policy (IGNORED_FIELDS: accepted, logged once at
debug, no effect on the output); and those that would change the output if ignored, which
servelm does not implement: declared only so that setting them gets a 400 naming them, never
silent neglect.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      field_validator, model_validator)

import logging

from servelm.outputs import Logprob
from servelm.sampling_params import MAX_LOGPROBS

MAX_N = 16
_SEED_MAX = 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i


def _whole_number(v: Any) -> Any:
    """2.0 -> 2, as OpenAI accepts it; 2.5, strings and booleans stay refused."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# An integer field: strict, except that a float with no fractional part counts.
Int = Annotated[int, BeforeValidator(_whole_number)]


logger = logging.getLogger(__name__)

# Fields that carry metadata or a policy with no effect on one server's output: OpenAI's
# stored-completion and routing fields, and prompt_cache_key (a routing hint: one engine's
# prefix cache is already shared by every request with the same cache salt).
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier",
                  "prompt_cache_key", "verbosity")
_ignored_seen: set[str] = set()


def _log_ignored(request: BaseModel) -> None:
    """One debug line per ignored field name the first time a request sets it."""
    for name in IGNORED_FIELDS:
        if name not in _ignored_seen and getattr(request, name, None) is not None:
            _ignored_seen.add(name)
            logger.debug("request field %r accepted and ignored (metadata only)", name)


def _unsupported(name: str) -> ValueError:
    return ValueError(f"'{name}' is not supported by servelm")


def stream_options_need_stream(cls, v, info: ValidationInfo):
    """A field validator (every API with OpenAI's stream_options): only with stream true."""
    if v is not None and not info.data.get("stream"):
        raise ValueError("'stream_options' is only allowed when 'stream' is true")
    return v


def no_suffix(cls, v: str | None) -> str | None:
    """A field validator (completions, Ollama's generate): no fill-in-the-middle prompts."""
    if v:
        raise ValueError("'suffix' is not supported by servelm: it builds no "
                         "fill-in-the-middle prompts (the embedded model has no "
                         "<fim_prefix>/<fim_suffix>/<fim_middle> tokens)")
    return v


class _Request(BaseModel):
    # strict: a JSON true is not an integer and "3" is not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


class MetadataFields(_Request):
    """The fields that only carry metadata or policy (IGNORED_FIELDS): accepted, logged once
    at debug, no effect on the output; shared by every OpenAI-shaped request."""

    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _note_ignored(self):
        _log_ignored(self)
        return self


class StreamOptions(_Request):
    """What a stream carries besides choices: include_usage adds a final usage chunk."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: OpenAI's structured outputs."""

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": ...}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_its_type(self) -> "ResponseFormat":
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar
    (Lark or GBNF/EBNF), json_object."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(MetadataFields):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-(2**63), le=_SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # llama-server's: false keeps this request's prompt out of the prefix cache (nothing
    # read from it, and its blocks kept under a salt of its own, which no request shares)
    cache_prompt: bool = True
    # servelm extensions (vLLM's names)
    top_k: Int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: list[Int] | None = None
    # Prefix-cache blocks are shared only between requests with the same salt (vLLM's field),
    # so cached_tokens cannot tell one client what another sent.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Structured outputs, in OpenAI's form, vLLM's, or vLLM's older guided_* fields (one of).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # vLLM's: the top-N alternatives at every prompt position, in the response's
    # prompt_logprobs (not streamed: a chunk has no place for them, as in vLLM)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: disaggregated serving. {"do_remote_decode": true, "remote_host", "remote_port"}
    # asks a prefill server to send the prompt's KV to that decode server once it has run
    # (servelm.server.disaggregation); {"do_remote_prefill": true} is accepted, no effect.
    kv_transfer_params: dict | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v: int | None, info: ValidationInfo):
        if v is not None and info.data.get("stream"):
            raise ValueError("'prompt_logprobs' is not available with 'stream' true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, v: dict | None) -> dict | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias}")
        return v

    _stream_options_need_stream = field_validator("stream_options")(stream_options_need_stream)


class FunctionDefinition(_Request):
    """tools[].function: a function the model may call; parameters is its JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly that one."""

    type: Literal["function"]
    function: NamedFunction


class HistoryFunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the API returned it


class HistoryToolCall(_Request):
    """A tool call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


class ChatMessage(_Request):
    """One turn; content is a string or a list of {"type": "text", "text": ...} parts. An
    assistant turn may instead (or as well) hold tool_calls; a tool turn answers one of them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    # Last, so that its check sees the role and tool_calls; checked when absent too.
    content: Any = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            if not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
                raise ValueError("content is required (an assistant message may give "
                                 "tool_calls instead)")
            return v
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type",
                                                                                      "text"}:
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported, got {part!r:.80}")
        return v

    @model_validator(mode="after")
    def _roles_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has it")
        return self

    def to_template(self) -> dict:
        """The message as the chat template expects it ('developer' is OpenAI's new 'system';
        a tool call's arguments as the object they encode, as HF templates take them)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The chat template: vLLM's chat_template_kwargs (template variables, e.g.
    # enable_thinking) and chat_template (the Jinja source, instead of the model's).
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, min_length=1)
    # Given to the template as a variable (gpt-oss-style templates read it); "none" also
    # sets enable_thinking false (Qwen3-style) unless chat_template_kwargs says otherwise.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored (no model uses it)
    # Only text out: ["text"] is accepted, audio refused below.
    modalities: list[Literal["text", "audio"]] | None = None
    # Not implemented; declared so that using them is a 400 that names them.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator("modalities")
    @classmethod
    def _text_only_out(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError("'modalities' other than [\"text\"] is not supported by servelm "
                             "(it answers in text only)")
        return v

    def template_kwargs(self) -> dict[str, Any]:
        """The variables this request gives the chat template."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":
                variables.setdefault("enable_thinking", False)
        return variables

    @field_validator("functions", "function_call", "audio", "prediction",
                     "web_search_options")
    @classmethod
    def _unset_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            if info.field_name in ("functions", "function_call"):
                raise ValueError(f"'{info.field_name}' (deprecated by OpenAI) is not supported "
                                 f"by servelm: use 'tools' and 'tool_choice'")
            raise _unsupported(info.field_name)
        return v

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [t.function.name for t in v or []]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two tools are named {dup!r}")
        return v

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("'tool_choice' other than 'none' requires 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among "
                             f"the tools")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        return v


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions."""

    prompt: Any
    # OpenAI's default for completions; 0 only with echo (the prompt scored, nothing generated)
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt is prepended to each choice (and its logprobs to theirs)
    suffix: str | None = None
    best_of: Int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> list[str | list[int]]:
        """A string, a list of strings, a list of token ids, or a list of token id lists."""
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return [v]
        if is_ids(v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or is_ids(p) for p in v):
            return v
        raise ValueError("prompt must be a string, a list of strings, a non-empty list of token "
                         "ids, or a list of token id lists")

    _no_suffix = field_validator("suffix")(no_suffix)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("'best_of' different from 'n' is not supported by servelm")
        return v


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class RequestTimings(BaseModel):
    """servelm's per-request timings (seconds): an extension to the OpenAI responses."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    queue_time_s: float | None = None
    e2e_s: float | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's thought (--reasoning-parser), apart from the answer: vLLM's
    # reasoning_content and its newer name reasoning, the same text.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    metrics: RequestTimings
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's extension
    kv_transfer_params: dict | None = None  # what a prefill server sent (disaggregation)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: index, id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # the thought's new text, as in ChatResponseMessage
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    metrics: RequestTimings | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]          # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


# vLLM's prompt_logprobs: per prompt position None (the first) or token id -> Logprob
PromptLogprobs = list[dict[int, Logprob] | None]


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    metrics: RequestTimings
    kv_transfer_params: dict | None = None  # what a prefill server sent (disaggregation)


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metrics: RequestTimings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "servelm"
    # servelm's additions (as vLLM adds max_model_len): what is being served.
    family: str | None = None          # the model family (llama, qwen2, gemma3, ...)
    architecture: str | None = None    # the HF architecture name
    max_model_len: int | None = None
    # vLLM's: where the model comes from (a LoRA adapter's path), and an adapter's base model.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
