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

JSON is generated so that it ends, as llama.cpp's JSON grammars make it (bounded_schema): a
small model left free to add whitespace, digits or keys may add them until max_tokens.
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

# JSON written compactly, as json.dumps writes it: whitespace only in the separators
# (llguidance's options; a schema's own top-level "x-guidance" keys win).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Integers within RFC 8259's interoperable range (16 digits, as llama.cpp's grammars allow);
# numbers too, with at most NUMBER_DECIMALS digits after the point and no exponent.
MAX_SAFE_INTEGER = 2**53 - 1
NUMBER_DECIMALS = 9
# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


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


def _types(node: dict) -> set:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _bound(node: dict, side: str) -> float | None:
    """The schema's own minimum or maximum (inclusive or exclusive), if a number."""
    for key in (side, "exclusive" + side.capitalize()):
        v = node.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def _bound_node(node: dict, closed: bool) -> dict:
    """One schema node with its numbers bounded and, where `closed`, an object with listed
    properties closed to others; its subschemas likewise."""
    out = dict(node)
    types = _types(node)
    if types & {"integer", "number"}:
        lo, hi = _bound(node, "minimum"), _bound(node, "maximum")
        # Only a side the schema leaves open, and never past the other side's bound.
        if not {"minimum", "exclusiveMinimum"} & node.keys() and (hi is None
                                                                 or hi >= -MAX_SAFE_INTEGER):
            out["minimum"] = -MAX_SAFE_INTEGER
        if not {"maximum", "exclusiveMaximum"} & node.keys() and (lo is None
                                                                 or lo <= MAX_SAFE_INTEGER):
            out["maximum"] = MAX_SAFE_INTEGER
        if "number" in types and "multipleOf" not in node:
            out["multipleOf"] = float(f"1e-{NUMBER_DECIMALS}")
    if (closed and "properties" in node
            and not {"additionalProperties", "patternProperties",
                     "unevaluatedProperties"} & node.keys()):
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            out[key] = _bound_node(node[key], closed)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_bound_node(n, closed) if isinstance(n, dict) else n for n in node[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {k: _bound_node(n, closed) if isinstance(n, dict) else n
                        for k, n in node[key].items()}
    return out


def _merges_objects(node: Any) -> bool:
    """Whether an allOf anywhere joins several schemas (whose properties merge: closing
    each one would leave none of the others' keys)."""
    if isinstance(node, dict):
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return True
        return any(_merges_objects(v) for v in node.values())
    if isinstance(node, list):
        return any(_merges_objects(v) for v in node)
    return False


def bounded_schema(schema: dict) -> dict:
    """The schema as servelm generates it, so that an answer ends: compact JSON, integers
    and numbers within +-(2**53 - 1) (numbers with at most NUMBER_DECIMALS decimals), and
    an object with listed properties but no word on others closed to others (as llama.cpp
    and xgrammar's strict mode read it; OpenAI's strict schemas say so themselves), unless
    an allOf merges schemas. Bounds the schema gives itself are kept."""
    out = _bound_node(schema, closed=not _merges_objects(schema))
    out["x-guidance"] = {**JSON_FORMAT, **(schema.get("x-guidance") or {})}
    return out


def compact_schema(schema: dict) -> dict:
    """The schema as given, only written compactly (the fallback where bounds do not
    compile, e.g. a minimum past MAX_SAFE_INTEGER)."""
    return {**schema, "x-guidance": {**JSON_FORMAT, **(schema.get("x-guidance") or {})}}


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

    def _grammars(self, spec: StructuredOutputsParams) -> list[str]:
        """The spec's grammar, most bounded first: a JSON schema bounded, then as given
        (compact); the last one's error is the one reported."""
        import llguidance

        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError:
                        pass  # llguidance names the problem
                if not isinstance(schema, dict):
                    return [llguidance.LLMatcher.grammar_from_json_schema(schema)]
                return [llguidance.LLMatcher.grammar_from_json_schema(s)
                        for s in (bounded_schema(schema), compact_schema(schema))]
            if kind == "regex":
                return [llguidance.LLMatcher.grammar_from_regex(spec.regex)]
            if kind == "choice":
                return [llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in spec.choice))]
            return [llguidance.grammar_from("grammar", spec.grammar)]
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
        for grammar in self._grammars(spec):
            m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if not m.is_error():
                break
        else:
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
_prefetcher = None


def _compute_masks(matchers: list, bits_ptr: int, words: int) -> None:
    """The matchers' next-token bitmasks into int32 rows of `words` at bits_ptr (no torch:
    llguidance's own threads, the GIL released)."""
    import llguidance

    global _executor
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(bits_ptr, words * 4)
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits_ptr,
                                      words * 4, len(matchers))


def _unpack(bits: "torch.Tensor", vocab: int) -> "torch.Tensor":
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    return (((bits.unsqueeze(-1) >> shifts) & 1).reshape(bits.shape[0], -1)[:, :vocab]) != 0


def allowed_mask(matchers: list, vocab: int) -> "torch.Tensor":
    """[len(matchers), vocab] bool: the tokens each matcher allows next; several rows are
    computed in parallel by llguidance's own threads. (llguidance.torch is not used: it
    applies torch.compile at import, which imports torch._dynamo, seconds.)"""
    import torch

    words = (vocab + 31) // 32
    bits = torch.zeros((len(matchers), words), dtype=torch.int32)
    _compute_masks(matchers, bits.data_ptr(), words)
    return _unpack(bits, vocab)


def _compute_into(matchers: list, bits) -> None:
    """_compute_masks into a numpy buffer this call keeps alive while it writes."""
    _compute_masks(matchers, bits.ctypes.data, bits.shape[1])


class MaskPrefetch:
    """The next-token masks of matchers computed on a background thread while the step's
    forward runs (as vLLM and SGLang overlap them): a matcher only moves when its token is
    sampled, after the forward, so the masks started before it are the ones the sampler
    needs. The thread makes no torch call (a second thread's OpenMP regions would start a
    pool of their own); the bits are unpacked on the caller's thread by `get`."""

    def __init__(self, matchers: list, vocab: int):
        import concurrent.futures

        import numpy as np

        global _prefetcher
        if _prefetcher is None:
            _prefetcher = concurrent.futures.ThreadPoolExecutor(1, "servelm-masks")
        self.vocab = vocab
        self.rows = {id(m): i for i, m in enumerate(matchers)}
        words = (vocab + 31) // 32
        self._bits = np.zeros((len(matchers), words), dtype=np.int32)
        self._done = _prefetcher.submit(_compute_into, list(matchers), self._bits)
        self._mask: "torch.Tensor | None" = None

    def get(self, matcher) -> "torch.Tensor | None":
        """The [vocab] bool mask of a matcher given at construction, else None."""
        row = self.rows.get(id(matcher))
        if row is None:
            return None
        if self._mask is None:
            import torch

            self._done.result()
            self._mask = _unpack(torch.from_numpy(self._bits), self.vocab)
        return self._mask[row]

    def wait(self) -> None:
        """Block until the background work is done (its buffer must outlive it)."""
        self._done.result()
