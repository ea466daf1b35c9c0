"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from servelm.structured_outputs import StructuredOutputsParams

# A temperature below this is treated as greedy decoding (argmax).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction (ValueError names the field)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token; 0 = the sampled token's only
    # top-N alternatives at every prompt position (vLLM's prompt_logprobs); 0: the prompt
    # token's own logprob only. Such a request bypasses the prefix cache (every position
    # must be computed to have its logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # A grammar every sampled token keeps valid (JSON schema, regex, choice, Lark/EBNF).
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a bias in [-100, 100] added to its logit (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    _stop: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        # Reject non-sequences here: list() on them would raise TypeError, not ValueError.
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self._stop = list(self.stop or [])
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids or None, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {self.structured_outputs!r}")
        self._validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for s in self._stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for t, b in self.logit_bias.items():
                if not is_int(t) or t < 0 or not is_num(b) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias maps token ids >= 0 to biases in "
                                     f"[-100, 100], got {t!r}: {b!r}")
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
