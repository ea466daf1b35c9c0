"""Tokenizer: text <-> token ids, special ids and chat-template rendering.

A model's tokenizer comes either from the metadata of its GGUF file or from a Hugging Face model
directory (`tokenizer.json` and friends). Both end up as a `tokenizers.Tokenizer`, built so that its
ids match what transformers produces for the same files, and the chat template renders exactly as
transformers' `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import copy
import json
import os
from datetime import datetime
from functools import lru_cache
from itertools import compress
from operator import itemgetter
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer


# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes for the GGUF `tokenizer.ggml.pre` names whose merges were learned on a split other
# than GPT-2's. The names and regexes are the ones transformers uses when it loads a GGUF, so ids
# match it; any other name (including SmolLM's 'smollm') gets GPT-2's byte-level split, as there.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Wraps a Hugging Face `tokenizers.Tokenizer` plus the chat template and special ids.

    Build one with `from_gguf`, `from_dir` or `load_tokenizer`. `encode` adds BOS/EOS only where the
    model asks for them (`add_bos_token` / `add_eos_token`, or the post-processor in `tokenizer.json`).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ):
        """`add_bos_token`/`add_eos_token` of None keep the backend's own post-processor, if it has one."""
        self._backend = backend
        self._special_tokens = {
            name: token
            for name, token in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("unk_token", unk_token),
                ("pad_token", pad_token),
            )
            if token is not None
        }
        self.bos_token_id = self._token_id(bos_token)
        self.eos_token_id = self._token_id(eos_token)
        self.pad_token_id = self._token_id(pad_token)
        self.unk_token_id = self._token_id(unk_token)
        eos_ids = {i for i in (self.eos_token_id, *extra_eos_token_ids) if i is not None}
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.chat_template = chat_template
        # Template variables every render gets unless the call overrides them
        # (--chat-template-kwargs).
        self.default_template_kwargs: dict[str, Any] = {}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added_special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        named = {self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id} - {None}
        self.special_token_ids: frozenset[int] = frozenset(added_special | named | eos_ids)
        # Mirrors transformers: explicit flags (or a missing post-processor) rebuild the post-processor.
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self._max_token_chars: int | None = None
        self._token_texts: dict[int, str] = {}

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        add_bos = add_bos and self.bos_token_id is not None
        add_eos = add_eos and self.eos_token_id is not None
        bos, eos = self.bos_token, self.eos_token
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = ([(bos, self.bos_token_id)] if add_bos else []) + ([(eos, self.eos_token_id)] if add_eos else [])
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes from its metadata (key -> Python value).

        Byte-level BPE ('gpt2') and SentencePiece ('llama': Llama 2, Mistral, Gemma 1-3;
        'gemma4': Gemma 4's, the same kind of vocabulary with its merges) vocabularies;
        ValueError otherwise.
        """
        meta = _GGUFMeta(metadata)
        kind = meta.get("tokenizer.ggml.model")
        if kind in ("llama", "gemma4"):
            return cls._from_gguf_sentencepiece(meta)
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: byte-level "
                             f"BPE 'gpt2', SentencePiece 'llama' and 'gemma4')")
        tokens = meta.require("tokenizer.ggml.tokens")
        merges = meta.require("tokenizer.ggml.merges")
        token_types = meta.get("tokenizer.ggml.token_type") or []

        # Tokens are stored in the byte alphabet; a token using other characters is spelled as raw
        # UTF-8 and needs re-spelling so the BPE model can find it.
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        spelled = [
            tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8")) for tok in tokens
        ]
        vocab = {tok: i for i, tok in enumerate(spelled)}
        backend = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ")) for m in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = _GGUF_PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()

        # Control tokens must be matched whole in text and skipped when decoding; one spelled outside
        # the byte alphabet is a mislabel in the file, and transformers skips it too.
        control = [
            AddedToken(tok, normalized=False, special=True)
            for tok, token_type in zip(tokens, token_types)
            if token_type == _CONTROL and set(tok) <= letters
        ]
        user_defined = [
            AddedToken(tok, normalized=False, special=False)
            for tok, token_type in zip(tokens, token_types)
            if token_type == _USER_DEFINED and tok in vocab
        ]
        if control:
            backend.add_special_tokens(control)
        if user_defined:
            backend.add_tokens(user_defined)

        return cls(backend, **_gguf_special_tokens(meta, tokens, add_bos_default=False))

    @classmethod
    def _from_gguf_sentencepiece(cls, meta: "_GGUFMeta") -> Tokenizer:
        """A SentencePiece BPE vocabulary (tokens with scores, byte-fallback tokens <0xNN>),
        rebuilt as transformers rebuilds it from a GGUF, so ids match: merges from the file,
        or derived from the vocabulary (every split of a token into two tokens), best first
        by score; Gemma's files order merges by position, not score, and store runs of
        spaces as real spaces. Gemma marks spaces with a normalizer and adds no prefix
        space; the others prepend one with Metaspace."""
        tokens = list(meta.require("tokenizer.ggml.tokens"))
        token_types = meta.get("tokenizer.ggml.token_type") or []
        gemma = str(meta.get("general.architecture", "")).startswith("gemma")
        if gemma:
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
            scores = {t: -i for i, t in enumerate(tokens)}
        else:
            scores = dict(zip(tokens, meta.require("tokenizer.ggml.scores")))
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = meta.get("tokenizer.ggml.merges")
        merges = ([tuple(m.split(" ")) for m in merges] if merges
                  else _merges_from_vocab(vocab, scores))
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                         byte_fallback=True, unk_token=unk, dropout=None))
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gemma:
            backend.normalizer = normalizers.Replace(" ", "\u2581")
            backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        else:
            prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
            if prefix:
                steps.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(steps)
        control = [AddedToken(t, normalized=False, special=True)
                   for t, kind in zip(tokens, token_types) if kind == _CONTROL]
        user = [AddedToken(t, normalized=False, special=False)
                for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        return cls(backend, **_gguf_special_tokens(meta, tokens, add_bos_default=True))

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load from a Hugging Face model directory.

        Reads `tokenizer.json` (required), `tokenizer_config.json`, and where present
        `special_tokens_map.json`, `chat_template.jinja` / `chat_template.json` and
        `generation_config.json` (whose `eos_token_id` list adds end-of-turn ids).
        BOS/EOS are added as `tokenizer.json`'s post-processor says; like transformers 5, the
        `add_bos_token` / `add_eos_token` of `tokenizer_config.json` are then ignored.
        """
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{tokenizer_file}: not found (a model directory needs a tokenizer.json)")
        backend = HFTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            return value.get("content") if isinstance(value, dict) else value

        extra_eos = generation.get("eos_token_id", ())
        if isinstance(extra_eos, int):
            extra_eos = (extra_eos,)
        return cls(
            backend,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            unk_token=special("unk_token"),
            pad_token=special("pad_token"),
            extra_eos_token_ids=tuple(extra_eos),
            chat_template=_read_dir_chat_template(path, config),
        )

    # ---- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text are matched whole.

        `add_special_tokens` adds BOS/EOS only where the model asks for them. Thread-friendly:
        the batch call lets go of the GIL while it works (a plain encode() holds it, ~1 s a
        MB of text), so a server tokenising in a worker thread keeps answering meanwhile.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int:
        """The longest token's text: no token covers more characters of a prompt than this,
        so a text of c characters is at least c / max_token_chars tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._backend.get_vocab()), default=1)
        return self._max_token_chars

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid or incomplete UTF-8 shows as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (as logprobs show it); cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def get_vocab(self) -> dict[str, int]:
        """Every token's vocabulary string (added tokens included) -> its id."""
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> list[str]:
        """The vocabulary strings (byte-alphabet spelling) of `ids`."""
        if isinstance(ids, int):
            ids = [ids]
        return [self._backend.id_to_token(i) for i in ids]

    # ---- chat template --------------------------------------------------------------------------

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (else the caller describes them)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render `messages` with the model's chat template, as transformers does (tokenize=False).

        A message's `content` may be a string or a list of `{"type": "text", "text": ...}` parts,
        which are joined with newlines. `chat_template` renders with that template instead of
        the model's; `template_kwargs` become template variables (vLLM's
        chat_template_kwargs, e.g. enable_thinking), over `default_template_kwargs`. ValueError
        if there is no template, a part is not text, or the template rejects the conversation.
        """
        source = chat_template or self.chat_template
        if not source:
            raise ValueError(NO_CHAT_TEMPLATE)
        conversation = [_flatten_message(m) for m in messages]
        variables = {**self.default_template_kwargs, **(template_kwargs or {})}
        for name in ("messages", "tools", "add_generation_prompt"):
            variables.pop(name, None)  # these are the request's own
        try:
            return _compile_template(source).render(
                **{"documents": None, **self._special_tokens, **variables},
                messages=conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


# The tokens that end an answer wherever a GGUF vocabulary has them, whatever ids its
# metadata names (llama.cpp's end-of-generation set, found by the same texts): many files
# name only their eos (Gemma's <eos>, gpt-oss's <|return|>) while chats end at end-of-turn
# tokens (an HF checkpoint lists them in generation_config.json instead).
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
                     "<|end_of_text|>", "<end_of_turn>", "<turn|>", "<|tool_response>",
                     "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>",
                     "<｜end▁of▁sentence｜>")


def _end_of_generation(tokens: list[str]) -> tuple[int, ...]:
    """The ids of END_OF_GENERATION's texts in a vocabulary. gpt-oss's harmony format (both
    <|return|> and <|call|>) ends each message of an answer with <|end|>: not an end there."""
    ids = {t: i for i, t in enumerate(tokens) if t in END_OF_GENERATION}
    if "<|return|>" in ids and "<|call|>" in ids:
        ids.pop("<|end|>", None)
    return tuple(sorted(ids.values()))


def _gguf_special_tokens(meta: "_GGUFMeta", tokens: list[str], add_bos_default: bool) -> dict:
    """Tokenizer keyword arguments from a GGUF's special-token ids and flags."""

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    extra_eos = tuple(
        i for i in (meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
        if i is not None
    )
    extra_eos += _end_of_generation(tokens)
    return dict(
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        extra_eos_token_ids=extra_eos,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: (left, right) for every token that splits into
    two tokens, ordered by the merged token's score (best first), then by the parts' lengths
    (the longer left part first), ties in the order of `scores` (a token's splits differ in
    their left part's length, so never tie). The splits are found one position at a time
    over every token long enough, slicing and looking up in C (map), the right part sliced
    only where the left part is a token; then one stable sort orders them."""
    import numpy as np

    tokens = list(scores)
    live = [k for k, t in enumerate(tokens) if len(t) > 1]
    found_k: list[int] = []
    found_at: list[int] = []
    lefts: list[str] = []
    rights: list[str] = []
    known = vocab.__contains__
    i = 1
    while live:
        words = [tokens[k] for k in live]
        heads = list(map(itemgetter(slice(None, i)), words))
        is_token = list(map(known, heads))
        ks = list(compress(live, is_token))
        heads = list(compress(heads, is_token))
        tails = list(map(itemgetter(slice(i, None)), compress(words, is_token)))
        both = list(map(known, tails))
        found_k += compress(ks, both)
        lefts += compress(heads, both)
        rights += compress(tails, both)
        found_at += [i] * sum(both)
        i += 1
        live = [k for k, t in zip(live, words) if len(t) > i]
    k = np.array(found_k, dtype=np.int64)
    left_len = np.array(found_at, dtype=np.int64)
    right_len = np.array([len(t) for t in tokens], dtype=np.int64)[k] - left_len
    score = np.array(list(scores.values()), dtype=np.float64)[k]
    order = np.lexsort((k, -right_len, -left_len, -score))  # the last key sorts first
    return [(lefts[j], rights[j]) for j in order.tolist()]


NO_CHAT_TEMPLATE = ("the model has no chat template (a base model?): pass one with "
                    "--chat-template FILE_OR_JINJA (serve, chat, generate), chat_template= "
                    "(LLM.chat) or the request's 'chat_template' field, or send a plain prompt "
                    "to /v1/completions")


def load_chat_template(value: str) -> str:
    """--chat-template's argument: a file's path (read), or the Jinja source itself (as vLLM
    takes it). The template is compiled here, so a broken one fails at start-up."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
        if value.endswith(".json"):  # a chat_template.json, as HF repos ship it
            source = json.loads(source).get("chat_template", "")
    elif any(c in value for c in "{}\n"):
        source = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (and not an inline Jinja "
                         f"template)")
    if not source or not isinstance(source, str):
        raise ValueError(f"--chat-template {value!r} holds no template")
    _compile_template(source)  # ValueError naming the syntax error
    return source


def load_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer of a `.gguf` file or of a Hugging Face model directory.

    ValueError naming `path` and the reason if it is missing or unusable.
    """
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    from servelm.models.paths import read_gguf, resolve_model_path

    path = resolve_model_path(path)
    return gguf_tokenizer(path, read_gguf(path).metadata)


# The last few GGUF tokenizers built, by the metadata they came from (the same object while
# models.paths keeps that file's parsed header): building the BPE model from a vocabulary is
# ~0.15 s, again for every engine of a process on the same file. Each caller gets its own
# shallow copy, so setting its chat template or template variables stays its own; the
# tokenizers backend (never changed after construction) and the token-text caches are shared.
_GGUF_TOKENIZERS: list[tuple[dict, Tokenizer]] = []
_GGUF_TOKENIZERS_KEPT = 4


def gguf_tokenizer(path: str, metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; what it lacks or holds wrong is a
    ModelLoadError naming the file."""
    from servelm.models.paths import ModelLoadError

    built = next((t for m, t in _GGUF_TOKENIZERS if m is metadata), None)
    if built is None:
        try:
            built = Tokenizer.from_gguf(metadata)
        except (KeyError, ValueError, IndexError) as e:
            raise ModelLoadError(f"{path}: cannot build a tokenizer: {e}") from e
        _GGUF_TOKENIZERS.append((metadata, built))
        del _GGUF_TOKENIZERS[:-_GGUF_TOKENIZERS_KEPT]
    return copy.copy(built)


class _GGUFMeta:
    """Reads GGUF metadata values as plain Python (str, int, bool, lists)."""

    def __init__(self, metadata: dict[str, Any]):
        self._meta = metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable JSON: {e}") from e


def _read_dir_chat_template(path: str, config: dict) -> str | None:
    """The template transformers would use: chat_template.jinja, else tokenizer_config, else chat_template.json."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(path, "chat_template.json")).get(
        "chat_template"
    )
    if isinstance(template, list):
        # Named templates: [{"name": ..., "template": ...}]; plain chat uses "default".
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _flatten_message(message: dict) -> dict:
    """A copy of `message` with None values dropped (as transformers does) and content as one string."""
    flat = {key: value for key, value in message.items() if value is not None}
    content = flat.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"unsupported message content part of type {kind!r} (only 'text' is supported)")
            texts.append(part["text"])
        flat["content"] = "\n".join(texts)
    return flat


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by training templates) and renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict` for templates, limited to construction so it offers no attribute access to escape by."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` for templates that refuses underscore names, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e}") from e
