"""Which backend a request goes to: cache-aware (the longest cached prefix, unless that
backend is too loaded), least loaded, or round robin (no network, no torch).

A backend's view here is what the router knows of it: whether it is up, the block digests
its prefix cache holds (applied from its cache events, in order), the block size and
whether it has API keys (how its digests are computed), and its load in tokens: the more
of the tokens of the requests the router has in flight there (prompt plus expected output),
which it knows at once, and the running plus waiting tokens the backend last reported
(GET /v1/stats), which count other clients' requests too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

POLICIES = ("cache_aware", "round_robin", "least_loaded")

# Why a request went where it did (the router's counters, /metrics and /v1/stats).
CACHE_HIT, LOAD, ROUND_ROBIN = "cache_hit", "load", "round_robin"
REASONS = (CACHE_HIT, LOAD, ROUND_ROBIN)


def _parse_digest(text: str) -> int:
    return int(text, 16)


@dataclass
class BackendView:
    """One backend as the policy sees it."""

    url: str
    up: bool = True
    servelm: bool | None = None   # None: not known yet; False: no /v1/cache_events
    block_size: int | None = None
    keyed: bool = False           # its API keys salt the cache per key
    instance: str | None = None   # its event log's id (a restarted server: a new one)
    seq: int | None = None        # the last cache event applied
    cached: set[int] = field(default_factory=set)
    load_tokens: int = 0          # the router's requests in flight there, in tokens
    inflight: int = 0             # ... and in requests
    reported_tokens: int = 0      # running + waiting tokens, from its last /v1/stats

    @property
    def load(self) -> int:
        return max(self.load_tokens, self.reported_tokens)

    def apply_events(self, report: dict) -> None:
        """Apply one GET /v1/cache_events answer: its events in order, or its snapshot."""
        if not report.get("enabled", True):
            self.servelm, self.cached, self.seq = True, set(), None
            self.block_size = report.get("block_size")
            return
        self.servelm = True
        self.block_size = report["block_size"]
        self.keyed = bool(report.get("keyed"))
        if report.get("reset") or report.get("instance") != self.instance:
            self.cached = {_parse_digest(d) for d in report.get("blocks", ())}
        for kind, digest in report.get("events", ()):
            if kind == "stored":
                self.cached.add(_parse_digest(digest))
            elif kind == "removed":
                self.cached.discard(_parse_digest(digest))
        self.instance = report.get("instance")
        self.seq = report["seq"]

    def forget_cache(self) -> None:
        """What it held is unknown again (it went down; it may come back another instance)."""
        self.cached, self.seq, self.instance = set(), None, None

    def cached_prefix_blocks(self, digests: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its digests, in order) this backend holds."""
        n = 0
        for d in digests:
            if d not in self.cached:
                break
            n += 1
        return n


@dataclass
class Choice:
    backend: BackendView
    reason: str
    cached_blocks: int = 0


class Policy:
    """Picks a backend per request among those up.

    cache_aware: the backend holding the longest cached prefix of the prompt (the least
    loaded of those tied), unless its load exceeds the least loaded backend's by more than
    load_bound tokens; else the least loaded; ties in turn (round robin).
    least_loaded: the least loaded, ties in turn. round_robin: each in turn.
    """

    def __init__(self, name: str = "cache_aware", load_bound: int = 4096):
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}: choose one of "
                             f"{', '.join(POLICIES)}")
        if load_bound < 0:
            raise ValueError(f"the load bound must be >= 0 tokens, got {load_bound}")
        self.name = name
        self.load_bound = load_bound
        self._turn = 0

    def _next_of(self, candidates: list[BackendView], order: list[BackendView]) -> BackendView:
        """The candidate that comes next in turn (order: every backend, as configured)."""
        n = len(order)
        for k in range(n):
            b = order[(self._turn + k) % n]
            if b in candidates:
                self._turn = (order.index(b) + 1) % n
                return b
        raise AssertionError("a candidate outside the backends")

    def choose(self, backends: list[BackendView], digests_for=None,
               exclude: Iterable[BackendView] = ()) -> Choice | None:
        """The backend for a request, or None when none is up (or all are excluded: tried).

        digests_for(block_size, keyed) -> the prompt's block digests as a backend with that
        block size and keying computes them ([] when unknown); called only for cache_aware
        and only for servelm backends."""
        skip = set(map(id, exclude))
        live = [b for b in backends if b.up and id(b) not in skip]
        if not live:
            return None
        if self.name == "round_robin":
            return Choice(self._next_of(live, backends), ROUND_ROBIN)
        if self.name == "cache_aware" and digests_for is not None:
            memo: dict[tuple, Sequence[int]] = {}
            hits = {}
            for b in live:
                if b.servelm and b.block_size and b.cached:
                    k = (b.block_size, b.keyed)
                    if k not in memo:
                        memo[k] = digests_for(*k)
                    hits[id(b)] = b.cached_prefix_blocks(memo[k])
            best = max(hits.values(), default=0)
            if best > 0:
                holders = [b for b in live if hits.get(id(b)) == best]
                least = min(b.load for b in live)
                low = min(b.load for b in holders)
                if low - least <= self.load_bound:
                    pick = self._next_of([b for b in holders if b.load == low], backends)
                    return Choice(pick, CACHE_HIT, best)
        least = min(b.load for b in live)
        tied = [b for b in live if b.load == least]
        reason = LOAD if len(tied) < len(live) else ROUND_ROBIN
        return Choice(self._next_of(tied, backends), reason)
