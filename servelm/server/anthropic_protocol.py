"""Anthropic's Messages API requests (POST /v1/messages, /v1/messages/count_tokens): their
schema, and their translation into the one internal request, a ChatCompletionRequest.

As Anthropic's API does, unknown fields are refused; fields that only carry metadata or a
policy with no effect on one server's output (metadata, service_tier, cache_control,
inference_geo, speed, diagnostics, user_profile_id, workspace_id) are accepted and ignored.
Content is text: image, document and server-tool blocks are refused naming their type.

The translation: `system` (and system turns) -> system messages; text blocks -> text parts;
an assistant's tool_use blocks -> its tool_calls (ids kept, input as JSON arguments); each
tool_result block -> a tool message; thinking blocks of earlier turns are dropped; tools ->
function tools; tool_choice any -> "required", tool -> named, disable_parallel_tool_use ->
parallel_tool_calls false. A final assistant turn is a prefill: the answer continues it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from servelm.server.protocol import ChatCompletionRequest, Int, _Request

# Block types Anthropic defines that servelm does not read, and why.
_MEDIA = ("image", "document", "search_result", "container_upload")


def _known_blocks(allowed: tuple[str, ...]):
    """A before-validator: a list of blocks whose types are all in `allowed`, else a
    ValueError naming the block and its type (pydantic's union error would list every
    member instead)."""

    def check(v: Any) -> Any:
        if not isinstance(v, list):
            return v
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in allowed:
                continue
            if kind in _MEDIA:
                raise ValueError(f"block {i}: '{kind}' content blocks are not supported by "
                                 f"servelm (it reads text only)")
            raise ValueError(f"block {i}: content block type {kind!r} is not supported here "
                             f"(expected one of {', '.join(allowed)})")
        return v

    return BeforeValidator(check)


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None   # prompt caching is automatic here
    citations: list | None = None       # a returned block passed back keeps them


class ToolUseBlock(_Request):
    """A tool call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict
    cache_control: dict | None = None
    caller: dict | None = None


class ToolResultBlock(_Request):
    """The result of a tool call: text, or text blocks; is_error marks a failed call."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[str | list[TextBlock], _known_blocks(("text",))] = ""
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(
            b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]
_BY_ROLE = {"user": ("text", "tool_result"),
            "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
            "system": ("text",)}


class Message(_Request):
    role: Literal["user", "assistant", "system"]
    content: Annotated[str | list[Block],
                       _known_blocks(("text", "tool_result", "tool_use", "thinking",
                                      "redacted_thinking"))]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> "Message":
        for i, b in enumerate(self.content if isinstance(self.content, list) else []):
            if b.type not in _BY_ROLE[self.role]:
                raise ValueError(f"block {i}: a {self.role} message cannot hold '{b.type}' "
                                 f"blocks")
        return self


class Tool(_Request):
    """A client tool: its name, description and the JSON schema of its input."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None  # input is always streamed as it is written

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict) -> dict:
        if v.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        return v


def _client_tools(v: Any) -> Any:
    """Server tools (web search, code execution ...) are Anthropic's own: refused by type."""
    for i, tool in enumerate(v if isinstance(v, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool {i}: tool type {kind!r} (a server tool) is not supported "
                             f"by servelm; give client tools with name and input_schema")
    return v


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if (self.name is not None) != (self.type == "tool"):
            raise ValueError("'name' is required with type 'tool', and only then")
        return self


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Request):
    user_id: str | None = None


class CountTokensRequest(_Request):
    """Body of POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: Annotated[str | list[TextBlock], _known_blocks(("text",))] | None = None
    tools: Annotated[list[Tool], BeforeValidator(_client_tools)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Metadata and policy only: accepted, no effect on the output.
    cache_control: dict | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "CountTokensRequest":
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice type '{choice.type}' requires 'tools'")
        if choice is not None and choice.type == "tool" and choice.name not in {
                t.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        names = [t.name for t in self.tools or []]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two tools are named {dup!r}")
        return self


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)  # 0: all tokens
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict | None = None


# ---- the translation ------------------------------------------------------------------------


def _parts(content: str | list) -> str | list[dict]:
    """Text content as the chat request takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": b.text} for b in content if b.type == "text"]


def _messages(req: CountTokensRequest) -> tuple[list[dict], str | None]:
    """The chat messages, and the final assistant turn's text when it is a prefill."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _parts(req.system)})
    turns, prefill = list(req.messages), None
    if turns[-1].role == "assistant":
        last = turns.pop()
        blocks = [] if isinstance(last.content, str) else last.content
        if any(b.type == "tool_use" for b in blocks):
            raise ValueError(f"messages.{len(turns)}: a final assistant message (a prefill, "
                             f"which the answer continues) may hold text only, not tool_use")
        parts = _parts(last.content)
        prefill = parts if isinstance(parts, str) else "".join(p["text"] for p in parts)
    for m in turns:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name,
                                   "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in m.content if b.type == "tool_use"]
            # A string: the tool description path appends calls to it (chat.describe_tools).
            text = "\n".join(b.text for b in m.content if b.type == "text")
            out.append({"role": "assistant", "content": text or (None if calls else ""),
                        **({"tool_calls": calls} if calls else {})})
        else:
            text: list[dict] = []
            for b in m.content:
                if b.type == "tool_result":
                    if text:
                        out.append({"role": m.role, "content": text})
                        text = []
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": b.text()})
                elif b.type == "text":
                    text.append({"type": "text", "text": b.text})
            if text or not m.content:
                out.append({"role": m.role, "content": text})
    return out, prefill


_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def to_chat(req: CountTokensRequest, model: str) -> tuple[ChatCompletionRequest, str | None]:
    """The chat request this Messages request is, and its prefill (the final assistant
    turn's text, which the prompt ends with), if any. ValueError: a conversation the chat
    request cannot express."""
    messages, prefill = _messages(req)
    body: dict[str, Any] = {"model": model, "messages": messages}
    if req.tools and not (req.tool_choice and req.tool_choice.type == "none"):
        body["tools"] = [{"type": "function",
                          "function": {"name": t.name, "parameters": t.input_schema,
                                       **({"description": t.description}
                                          if t.description is not None else {})}}
                         for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if choice.type == "tool" else
                                   {"any": "required", "auto": "auto"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    config = req.output_config
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = _EFFORT[config.effort]
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output",
                                                   "schema": config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stream=req.stream)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    else:
        body["max_tokens"] = 1  # only the prompt is counted
    return ChatCompletionRequest.model_validate(body), prefill
