"""POST /tokenize and POST /detokenize, in vLLM's shape: a prompt (or a conversation, with
its tools, through the chat template) to token ids, and token ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from servelm.server.errors import APIError
from servelm.server.chat import describe_tools
from servelm.server.protocol import ChatMessage, Int, ToolDefinition, _Request
from servelm.server.serving import ServingContext, encode_prompt


class TokenizeRequest(_Request):
    """Exactly one of prompt (text) or messages (rendered by the chat template first, with
    `tools` as a chat request with them renders them; like vLLM's, no tool_choice)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, min_length=1)
    # As the chat route takes them (vLLM's TokenizeChatRequest has them too).
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's defaults: special tokens (BOS ...) for a prompt, none for a rendered conversation
    # (its template writes them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    return_token_strs: bool = False



class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    """The request's token ids (in a worker thread: the work grows with the text)."""
    tok = ctx.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "exactly one of 'prompt' and 'messages' is required",
                       param="prompt" if req.prompt is None else "messages", code="invalid_value")
    for name in ("add_generation_prompt", "tools", "chat_template", "chat_template_kwargs"):
        if getattr(req, name) is not None and req.messages is None:
            raise APIError(400, f"'{name}' applies to 'messages' only", param=name,
                           code="invalid_value")
    if req.messages is not None:
        # As the chat route renders them (chat.prepare), so the ids are what it would prefill.
        messages = [m.to_template() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if not tok.renders_tools and (tools or any(m.get("tool_calls") for m in messages)):
            messages = describe_tools(messages, tools)
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt is not False,
                tools=tools, chat_template=req.chat_template,
                template_kwargs=req.chat_template_kwargs)
        except ValueError as e:
            param = "chat_template" if req.chat_template else "messages"
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        fields, special = {"": "messages"}, bool(req.add_special_tokens)
    else:
        text, fields = req.prompt, {"": "prompt"}
        special = req.add_special_tokens is not False
    ids = encode_prompt(ctx, text, fields, add_special_tokens=special)
    strs = ([tok.decode([t], skip_special_tokens=False) for t in ids]
            if req.return_token_strs else None)
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.engine.max_model_len,
                            tokens=ids, token_strs=strs)


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of the ids (special tokens included, as vLLM decodes them)."""
    vocab = min(ctx.engine.engine.model_config.vocab_size, ctx.engine.tokenizer.vocab_size)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise APIError(400, f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})",
                           param="tokens", code="invalid_value")
    return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(req.tokens,
                                                                 skip_special_tokens=False))
