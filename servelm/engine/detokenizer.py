"""Incremental detokenization of a generated token stream, with stop-string handling."""

from __future__ import annotations

from collections.abc import Sequence

from servelm.tokenizer import Tokenizer

# How many prompt tokens to decode along with the output, so that decoders which treat the first
# token of a sequence specially (e.g. sentencepiece dropping its leading space) see real context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    A delta never ends in a broken UTF-8 character and never contains the start of what may turn
    out to be a stop string. Each `add_token` decodes only a small window of recent tokens (the
    prefix-offset / read-offset technique), so the cost per token does not grow with the output.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        *,
        min_tokens: int = 0,
    ):
        """`min_tokens`: stop strings count only once this many tokens were added (as in vLLM, a
        stop string completed earlier is ordinary text)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character; decoding across that boundary would fold prompt
            # bytes into the output, so decode the output on its own.
            context = []
        self._ids = context
        # ids[prefix_offset:read_offset] is already-emitted text kept as decoding context;
        # ids[read_offset:] are tokens whose text is not yet known (e.g. half a character).
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._emitted: list[str] = []  # deltas handed out by get_delta
        self._pending = ""  # decoded text not handed out yet
        self._stop_match: str | None = None

    @property
    def text(self) -> str:
        """Full output text so far (after a stop match: the cut text).

        Tokens that do not yet decode to a complete character are not included until
        `get_delta(final=True)`.
        """
        return "".join(self._emitted) + self._pending

    @property
    def stop_match(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_match

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token.

        Returns the matched stop string if the output now contains one (the text is then cut
        exactly there, keeping the stop string only if include_stop_str_in_output), else None.
        Tokens added after a stop match are ignored and the match is returned again.
        """
        if self._stop_match is not None:
            return self._stop_match
        self._ids.append(token_id)
        self._num_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (a skipped special token) or an incomplete character: wait for more.
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(new_text[len(prefix_text) :])

    def _flush(self) -> None:
        """Decode tokens held for an incomplete character as they are (U+FFFD included)."""
        if self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._append(new_text[len(prefix_text) :])

    def _append(self, chunk: str) -> str | None:
        """Add decoded text and look for a stop string in the part of it `chunk` could complete."""
        if not chunk:
            return None
        # Earlier text was searched already, so a new match must end inside `chunk`; and text that
        # could start a stop string is never handed out, so every match lies within `_pending`.
        start = max(0, len(self._pending) - self._max_stop_len + 1)
        self._pending += chunk
        if not self._stops or self._num_tokens < self._min_tokens:
            return None
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            index = self._pending.find(s, start)
            if index >= 0:
                # The stop completed first in the stream wins; on a tie, the one starting earlier.
                key = (index + len(s), index, s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, index, s = best
        self._pending = self._pending[: end if self._include_stop else index]
        self._stop_match = s
        return s

    def _held_stop_prefix_len(self) -> int:
        """Length of the longest end of the pending text that a stop string starts with."""
        for k in range(min(self._max_stop_len - 1, len(self._pending)), 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def get_delta(self, final: bool = False) -> str:
        """Text not handed out yet.

        Until `final`, an incomplete character and a possible start of a stop string at the end
        are held back. `final=True` (or a stop match) releases everything.
        """
        if final and self._stop_match is None:
            self._flush()
        hold = 0 if final or self._stop_match is not None else self._held_stop_prefix_len()
        delta = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(delta) :]
        if delta:
            self._emitted.append(delta)
        return delta
