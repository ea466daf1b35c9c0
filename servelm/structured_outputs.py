"""Structured outputs: a grammar (JSON schema, JSON object, regex, choice, Lark/EBNF) that
every sampled token must keep valid, on llguidance. No torch at import: SamplingParams
holds these.

llguidance, not xgrammar: xgrammar's wheel requires transformers (and triton) at run time,
and transformers is only a test reference here; llguidance is one self-contained library
with the same job (vLLM and SGLang support both), a ~2 ms mask a step and ~1 ms compiles
for ordinary schemas on the embedded model.

A grammar is compiled once per distinct spec (cached) into a template matcher; each sample
gets a copy. Compiling happens wherever the request is prepared: the server does it in its
worker thread, before the request reaches the engine, so no step waits on a compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): `json` a JSON schema (dict or string), `regex`,
    `choice` a list of strings, `grammar` Lark or GBNF/EBNF, `json_object` any JSON object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; "
                             f"got {', '.join(set_) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A cache key: the kind and its canonical value."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; `kind` says which."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"structured_outputs.{kind}: {message}")
        self.kind = kind
        self.detail = message


class GrammarCompiler:
    """Specs -> matchers over one tokenizer; thread-safe, with an LRU cache of compiled
    templates (keyed by the spec)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 128):
        self._tokenizer = tokenizer
        self._eos = sorted(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self._ll = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (built on first use: ~0.4 s)."""
        if self._ll is None:
            import llguidance

            ll = llguidance.LLTokenizer(self._tokenizer._backend.to_str(),
                                        n_vocab=self.vocab_size, eos_token=self._eos)
            with self._lock:
                self._ll = self._ll or ll
        return self._ll

    def _grammar(self, spec: StructuredOutputsParams) -> str:
        import llguidance

        kind = spec.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(spec.json)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.regex)
            if kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec.choice))
            return llguidance.grammar_from("grammar", spec.grammar)
        except ValueError as e:
            raise GrammarError(kind, str(e)) from None

    def compile(self, spec: StructuredOutputsParams):
        """The spec's template matcher (compiled, or from the cache); GrammarError if the
        spec is invalid. Call matcher() for a sample's own copy."""
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._grammar(spec)
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(spec.kind, m.get_error().strip())
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher for one sample (a copy of the cached template)."""
        return self.compile(spec).deep_copy()


_executor = None


def allowed_mask(matchers: list, vocab: int) -> "torch.Tensor":
    """[len(matchers), vocab] bool: the tokens each matcher allows next; several rows are
    computed in parallel by llguidance's own threads. (llguidance.torch is not used: it
    applies torch.compile at import, which imports torch._dynamo, seconds.)"""
    import llguidance
    import torch

    global _executor
    words = (vocab + 31) // 32
    bits = torch.zeros((len(matchers), words), dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
    else:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                          bits.data_ptr(), words * 4, len(matchers))
    shifts = torch.arange(32, dtype=torch.int32)
    return (((bits.unsqueeze(-1) >> shifts) & 1).reshape(len(matchers), -1)[:, :vocab]) != 0
