"""A request's prompt as the backend will see it: the chat template rendered and tokenised
the way servelm's server does (servelm.server.chat / completions / anthropic), its cache
salt as the server derives it, and from these the block digests its prefix cache would
hold (servelm.engine.block_manager.prompt_digests). A request whose prompt cannot be told
here (a LoRA adapter's, a Responses request, a body that does not parse) has none: it is
routed by load."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from servelm.engine.block_manager import prompt_digests

# Routes whose body carries a prompt the router can tokenise.
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
DEFAULT_OUTPUT_TOKENS = 256  # expected output of a request that gives no max_tokens


def cache_salt(key_salt: str | None, request_salt: str | None,
               cache_prompt: bool = True) -> str | None:
    """The server's prefix-cache namespace of a request (servelm.server.api._cache_salt),
    None where it is a namespace of the request's own (nothing cached to find)."""
    if not cache_prompt:
        return None
    if key_salt is None and request_salt is None:
        return None
    return f"{key_salt or ''}/{request_salt or ''}"


def key_salt(api_key: str | None) -> str | None:
    """A keyed server's salt for a key (ServerOptions' rule: a digest of the key)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else None


@dataclass
class Prompt:
    """What the router knows of one request's prompt."""

    token_ids: list[int] | None = None   # None: not known (routed by load)
    request_salt: str | None = None
    cacheable: bool = True               # false: cache_prompt false, or a LoRA adapter's
    max_tokens: int | None = None
    _digests: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def load_tokens(self) -> int:
        """The tokens it adds to a backend's load: prompt plus expected output."""
        return self.num_tokens + (self.max_tokens or DEFAULT_OUTPUT_TOKENS)

    def digests(self, block_size: int, api_key: str | None) -> list[int]:
        """Its full blocks' digests as a backend of that block size computes them (with the
        client's key as its salt when api_key is given: a keyed backend)."""
        if self.token_ids is None or not self.cacheable:
            return []
        k = (block_size, api_key)
        if k not in self._digests:
            salt = cache_salt(key_salt(api_key), self.request_salt)
            self._digests[k] = prompt_digests(self.token_ids, block_size, salt)
        return self._digests[k]


class PromptReader:
    """Tokenises requests for routing: the tokenizer of the model the backends serve, the
    served model's name (a request naming anything else runs a LoRA adapter, whose blocks
    are salted by its load and so never predictable here)."""

    def __init__(self, tokenizer, model_name: str | None = None):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def read(self, path: str, body: dict) -> Prompt:
        """The prompt of a parsed JSON body sent to `path`; Prompt() when it cannot tell."""
        try:
            return self._read(path, body)
        except Exception:  # a body the server will refuse: routed by load, refused there
            return Prompt(max_tokens=_int(body.get("max_tokens")) if isinstance(body, dict)
                          else None)

    def _read(self, path: str, body: dict) -> Prompt:
        if not isinstance(body, dict):
            return Prompt()
        model = body.get("model")
        cacheable = (body.get("cache_prompt", True) is not False
                     and (self.model_name is None or model is None or model == self.model_name))
        salt = body.get("cache_salt")
        max_tokens = _int(body.get("max_completion_tokens") or body.get("max_tokens"))
        if path == CHAT:
            from servelm.server.protocol import ChatCompletionRequest

            ids = self._chat_ids(ChatCompletionRequest.model_validate(body))
        elif path == MESSAGES:
            from servelm.server.anthropic_protocol import MessagesRequest, to_chat

            req, prefill = to_chat(MessagesRequest.model_validate(body), model or "")
            ids = self._chat_ids(req)
            if prefill:
                ids += self.tokenizer.encode(prefill, add_special_tokens=False)
        elif path == COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:  # several prompts: each its own request on one backend
                return Prompt(max_tokens=max_tokens)
        else:
            return Prompt(max_tokens=max_tokens)
        return Prompt(ids, salt, cacheable, max_tokens)

    def _chat_ids(self, req) -> list[int]:
        """servelm.server.chat.prepare's prompt: the template over the messages (the tools
        written into them for a template that does not render tools), tokenised."""
        from servelm.server.chat import render, request_tools

        return self.tokenizer.encode(render(self.tokenizer, req, request_tools(req)[1]),
                                     add_special_tokens=False)


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
