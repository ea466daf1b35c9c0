"""Prompt lookup: draft tokens copied from what followed an earlier occurrence of the
sequence's last n tokens (no model, no torch)."""

from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams (min_n..max_n tokens) -> where their latest occurrence ends.

    Built incrementally: a sequence only grows (rejected drafts are never part of it), so
    each step indexes only the tokens added since the last. Invariant: every n-gram ending
    at or before `_indexed` is in `_ends`, and none ending later.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._indexed = 0  # n-grams ending at positions <= this (exclusive end) are indexed

    def _index_to(self, tokens: list[int], end: int) -> None:
        for e in range(self._indexed + 1, end + 1):
            for i, n in enumerate(range(self.min_n, self.max_n + 1)):
                if e >= n:
                    self._ends[i][tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (max_n down to min_n tokens) seen before; [] when none recurs.

        A match that runs into the suffix itself continues periodically (what followed it is
        then the draft so far), so a repeating pattern drafts k tokens, not just its period."""
        L = len(tokens)
        self._index_to(tokens, L - 1)  # the suffix itself (ending at L) must not match
        for i in range(self.max_n - self.min_n, -1, -1):
            n = self.min_n + i
            if n > L - 1:
                continue
            e = self._ends[i].get(tuple(tokens[L - n:]))
            if e is None:
                continue
            out: list[int] = []
            for j in range(k):
                out.append(tokens[e + j] if e + j < L else out[e + j - L])
            return out
        return []


class NgramProposer:
    """Drafts for the ngram method: each request keeps its own NgramIndex (req.draft_state)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens to follow reqs[i]'s tokens so far (prompt + output)."""
        out = []
        for req, k in zip(reqs, ks):
            if req.draft_state is None:
                req.draft_state = NgramIndex(self.min_n, self.max_n)
            out.append(req.draft_state.propose(req.token_slice(0, req.num_tokens), k))
        return out

    def release(self, req) -> None:
        """Nothing to drop: the index stays valid (a sequence's tokens never change, and a
        preempted request keeps them)."""
