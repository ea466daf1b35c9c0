"""OpenAI's Responses API, as servelm takes it: the request (strict), its input items, tools,
tool choice and text format, and the response object with its output items.

servelm keeps no responses (every request is `store` false): a conversation is sent whole,
as `input` items. The top level is a pydantic model with the API's own field names, so a bad
field is a 400 naming it; `input`, `tools` and `tool_choice` are lists of typed things told
apart by their `type`, read one by one (`parse_items`, `parse_tools`, `parse_tool_choice`)
so that an error names the item (`input[2].call_id`), not a union member.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (BaseModel, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from servelm.server.errors import APIError, from_validation_error
from servelm.server.protocol import (Int, MetadataFields, _Request,
                                     stream_options_need_stream)

# Output items that name a server-side tool: what OpenAI runs itself, servelm does not.
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                  "web_search_preview_2025_03_11", "file_search", "computer",
                  "computer_use_preview", "code_interpreter", "image_generation", "mcp",
                  "local_shell", "shell", "apply_patch", "custom", "tool_search", "namespace")
# include values that ask for nothing servelm would leave out: its reasoning is plain text in
# the reasoning item's content, so there is nothing encrypted to return.
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


# ---- input items ------------------------------------------------------------------------------


class TextPart(_Request):
    """A text content part: input_text (what a user, system or developer says), output_text
    (an earlier answer, as the API returned it) or refusal."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # an earlier answer's, sent back: not read
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _its_text(self) -> "TextPart":
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise ValueError(f"a {self.type} part needs '{field}'")
        return self

    @property
    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


class MessageItem(_Request):
    """A turn: role and content (a string or text parts)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text_parts(self) -> str | list[dict]:
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": p.value} for p in self.content]


class FunctionCallItem(_Request):
    """A call the model made earlier (sent back with the conversation)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    """What a call returned: a string, or input_text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.value for p in self.output)


class ReasoningItem(_Request):
    """An earlier answer's reasoning, sent back: accepted, and left out of the prompt (chat
    templates drop past turns' reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[_Request]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                    "function_call_output": FunctionCallOutputItem,
                                    "reasoning": ReasoningItem}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _validated(model: type[_Request], data: Any, prefix: str):
    """model.model_validate(data); a failure is a 400 naming the field under `prefix`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = from_validation_error(e)
    inner = err.param
    param = f"{prefix}.{inner}" if inner else prefix
    message = err.message
    if inner and f"'{inner}'" in message:
        message = message.replace(f"'{inner}'", f"'{param}'", 1)
    elif inner and message.startswith(f"{inner}: "):
        message = f"{param}: {message[len(inner) + 2:]}"
    else:
        message = f"{param}: {message}"
    raise APIError(400, message, param=param, code=err.code)


def parse_items(raw: str | list[Any]) -> list[InputItem]:
    """`input` as items: a string is one user message."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    if not raw:
        raise APIError(400, "'input' must not be empty", param="input", code="invalid_value")
    items: list[InputItem] = []
    for i, data in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(data, dict):
            raise APIError(400, f"'{where}' must be an item object", param=where,
                           code="invalid_value")
        kind = data.get("type", "message" if "role" in data else None)
        if kind not in _ITEMS:
            what = (f"input item type {kind!r} is not supported by servelm" if kind else
                    "an input item needs a 'type' (or a 'role', for a message)")
            raise APIError(400, f"{what}; it takes message, function_call, "
                                f"function_call_output and reasoning items",
                           param=f"{where}.type", code="unsupported_value")
        if kind == "message" and isinstance(data.get("content"), list):
            for j, part in enumerate(data["content"]):
                if isinstance(part, dict) and part.get("type") in _MEDIA_PARTS:
                    raise APIError(400, f"content part type {part['type']!r} is not supported "
                                        f"by servelm: it takes text only",
                                   param=f"{where}.content[{j}].type", code="unsupported_value")
        items.append(_validated(_ITEMS[kind], data, where))
    return items


# ---- tools, tool choice, text format ----------------------------------------------------------


class FunctionTool(_Request):
    """A function the model may call: the Responses shape (name at the top level)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def parse_tools(raw: list[Any] | None) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    for i, data in enumerate(raw or []):
        where = f"tools[{i}]"
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            what = (f"built-in tool {kind!r} is not supported by servelm (it runs no "
                    f"server-side tools)" if kind in BUILT_IN_TOOLS
                    else f"tool type {kind!r} is not supported by servelm")
            raise APIError(400, f"{what}; only 'function' tools", param=f"{where}.type",
                           code="unsupported_value")
        tools.append(_validated(FunctionTool, data, where))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"two tools are named {dup!r}", param="tools", code="invalid_value")
    return tools


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class AllowedTools(_Request):
    """{"type": "allowed_tools", "mode": "auto" | "required", "tools": [...]}: only these."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice | AllowedTools


def parse_tool_choice(raw: Any, tools: list[FunctionTool]) -> ToolChoice:
    """tool_choice, checked against the tools; absent: auto."""
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or an object, "
                                f"got {raw!r}", param="tool_choice", code="invalid_value")
        choice: ToolChoice = raw
    else:
        kind = raw.get("type") if isinstance(raw, dict) else None
        model = {"function": FunctionChoice, "allowed_tools": AllowedTools}.get(kind)
        if model is None:
            raise APIError(400, f"tool_choice type {kind!r} is not supported by servelm; "
                                f"it takes 'function' and 'allowed_tools'",
                           param="tool_choice.type", code="unsupported_value")
        choice = _validated(model, raw, "tool_choice")
    names = {t.name for t in tools}
    named = ([choice.name] if isinstance(choice, FunctionChoice) else
             [t.name for t in choice.tools] if isinstance(choice, AllowedTools) else [])
    if choice not in ("none", "auto") and not tools:
        raise APIError(400, "tool_choice other than 'none' or 'auto' needs 'tools'",
                       param="tool_choice", code="invalid_value")
    for name in named:
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice", code="invalid_value")
    return choice


class TextFormat(_Request):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema", "description", "strict"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "TextFormat":
        if self.type == "json_schema":
            missing = [f for f, v in (("name", self.name), ("schema", self.schema_)) if v is None]
            if missing:
                raise ValueError(f"a json_schema format needs {' and '.join(missing)}")
        elif any(v is not None for v in (self.name, self.schema_, self.description,
                                          self.strict)):
            raise ValueError(f"name, schema, description and strict belong to json_schema, "
                             f"not {self.type}")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; no model uses it


class ReasoningConfig(_Request):
    """reasoning.effort reaches the chat template (as chat's reasoning_effort); a summary is
    given only where there is one (servelm writes none)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Request):
    include_obfuscation: bool | None = None  # accepted: servelm pads no deltas


# ---- the request ------------------------------------------------------------------------------


class ResponsesRequest(MetadataFields):
    """Body of POST /v1/responses."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Int | None = Field(None, ge=1)  # a cap on built-in tool calls: none run
    # (the metadata-only fields: MetadataFields)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    background: bool | None = None
    # Not implemented; declared so that using them is a 400 that says why.
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    context_management: Any = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _no_state(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"'{info.field_name}' is not supported by servelm: it keeps no "
                             f"responses or conversations (every request is store=false); "
                             f"send the whole conversation as 'input' items")
        return v

    @field_validator("prompt", "top_logprobs", "context_management")
    @classmethod
    def _unset_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"'{info.field_name}' is not supported by servelm")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("'background' true is not supported by servelm: it keeps no "
                             "responses to poll; stream instead")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise ValueError("'truncation' 'auto' is not supported by servelm: it drops no "
                             "input; a conversation longer than the context is a 400")
        return v

    @field_validator("include")
    @classmethod
    def _includes(cls, v: list[str] | None) -> list[str] | None:
        for value in v or []:
            if value not in HARMLESS_INCLUDES:
                raise ValueError(f"include {value!r} is not supported by servelm")
        return v

    _stream_options_need_stream = field_validator("stream_options")(stream_options_need_stream)


# ---- the response -----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's billed cache writes: servelm bills none


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response: what was generated, and the request's parameters as they applied."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's parameters, as the SDK's Response carries them.
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = Field(default_factory=dict)
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: str = "default"
    top_logprobs: int = 0
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def output_text(self) -> str:
        return "".join(c.text for item in self.output if isinstance(item, OutputMessage)
                       for c in item.content)
