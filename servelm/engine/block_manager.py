"""BlockManager: the paged KV pool's bookkeeping: block tables, reference counts, prefix cache (no torch)."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from array import array
from collections import OrderedDict, deque
from functools import lru_cache
from itertools import islice

# A full block's identity: (the key id of the block before it, or for a first block the
# request's cache salt (-1 without one), its tokens). Chaining through the previous block
# makes a key stand for the whole prefix and its salt, and the dict compares the tokens
# themselves, so a hash collision can never alias two prefixes.
BlockKey = tuple[int | str, tuple[int, ...]]


def _root(salt: str | None) -> int | str:
    return -1 if salt is None else salt


_LITTLE = sys.byteorder == "little"
assert array("I").itemsize == 4, "token ids are digested as uint32"


@lru_cache(maxsize=1024)
def _salt_bytes(salt: str | None) -> bytes:
    """A salt's bytes in a block's digest: None and "" differ, and the length ends it."""
    if salt is None:
        return b"\x00"
    raw = salt.encode("utf-8", "surrogatepass")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def block_digest(parent: int, salt: str | None, tokens) -> int:
    """A full block's digest: a 64-bit BLAKE2b over the previous block's digest (0 for a
    first block), the request's cache salt and the block's token ids (little-endian
    uint32), so equal prefixes under equal salts give equal digests in any process.
    The router computes the same digests for a prompt (servelm.router)."""
    ids = array("I", tokens)
    if not _LITTLE:
        ids.byteswap()
    data = parent.to_bytes(8, "little") + _salt_bytes(salt) + ids.tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_digests(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """The digests of every full block of token_ids, in order (what a server that computed
    them holds in its prefix cache)."""
    out, parent = [], 0
    for i in range(len(token_ids) // block_size):
        parent = block_digest(parent, salt, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class CacheEventLog:
    """The prefix cache's changes as a bounded log of ("stored" | "removed", digest) events
    with sequence numbers, for a reader in another thread (the server's
    GET /v1/cache_events, which the router polls). A reader too far behind (or of another
    instance: a restarted server starts a new log) gets a snapshot of the digests cached
    now instead of a gap."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self.instance = os.urandom(8).hex()
        self._lock = threading.Lock()
        self._events: deque[tuple[str, int]] = deque(maxlen=capacity)
        self._seq = 0          # the last event's number (events are numbered from 1)
        self._live: set[int] = set()

    def stored(self, *digests: int) -> None:
        with self._lock:
            for digest in digests:
                self._seq += 1
                self._events.append(("stored", digest))
                self._live.add(digest)

    def removed(self, digest: int) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(("removed", digest))
            self._live.discard(digest)

    @property
    def seq(self) -> int:
        return self._seq

    def since(self, seq: int | None) -> tuple[int, list[tuple[str, int]] | None, list[int] | None]:
        """(the last event's number, the events after `seq` in order, None) while the log
        still holds them all; else (the number, None, every digest cached now). seq None:
        the snapshot."""
        with self._lock:
            last = self._seq
            first = last - len(self._events) + 1  # the oldest event held
            if seq is None or seq > last or seq < first - 1:
                return last, None, list(self._live)
            # The newest n from the right: a poll costs its new events, not the log's length
            # (the engine thread waits on this lock to log more).
            events = list(islice(reversed(self._events), last - seq))
            events.reverse()
            return last, events, None


class PrefixHit(list):
    """find_cached_prefix's answer for a pool with block groups: the first group's hit blocks
    (the list itself) and, per further group, its pages at the same positions (`groups`;
    a position out of that group's reach whose page is gone: any page id, masked)."""

    def __init__(self, blocks: list[int], groups: list[list[int]]):
        super().__init__(blocks)
        self.groups = groups


class BlockManager:
    """Hands out fixed-size KV blocks and takes them back; optionally shares full blocks.

    Invariants: a block's ref count equals the number of block tables holding it; a
    block with ref count 0 is in the free queue; with prefix caching, a free block may
    still hold a cached prefix, and is only overwritten (evicted) when the pool needs
    room, least recently freed first.

    With num_state_slots (a model with linear-attention layers: a recurrent state per
    sequence, servelm.engine.state_cache), each request holding a table also holds one
    state slot, taken with its first blocks and given back with them; a request finds
    no room while every slot is held. Such a state sums the whole sequence, so cached
    blocks alone cannot rebuild it: prefix caching beside it needs state snapshots
    (num_state_snapshots), each a copy of a sequence's state at the end of one cached
    block, kept least recently used first. A prefix is found only up to its last block
    that has a snapshot; admitting a request on it queues a restore (the snapshot copied
    into the request's slot before the step runs: take_restores). reserve_snapshot names
    the snapshot a step fills (its forward copies the state there on the way, at a block
    boundary inside or at the end of a prompt chunk, or a decode step's: each generating
    request keeps one at its latest boundary, from the free ones); it joins that block
    when the block is registered (cache_full_blocks), and goes with the block when the
    block is evicted.

    With a reach (every attention layer of the model a sliding window or an attention
    chunk: no query reads keys more than `reach` positions before it), a request's blocks
    wholly out of reach of its next token are given back as it goes (release_behind),
    and a prefix-cache hit holds only the hit blocks in reach: a sequence holds about
    reach + one step's tokens, however long it grows. A given-back block keeps its place
    in the table (block_table: attention masks those positions; the pool's blocks always
    hold finite values) but the request no longer holds it: owners() and the ref counts
    leave it out, and another request may take and overwrite it.

    With block groups (`groups`: a hybrid model, some attention layers windowed and some
    not, its cache layers split into groups of equal size, ModelConfig.kv_groups), a block
    id names a page of one group's layers, and each request holds a table per group, all
    filled from the one free queue: the first group's (a group of full-attention layers)
    is block_table, and `groups` gives the reach of each further one (0: full attention),
    whose tables (group_tables) give back their pages out of reach as the request grows.
    The prefix cache keys the first group's blocks as above; a further group's page at
    the same position joins the cache under that block, and goes when either is evicted.
    A hit needs every group's pages in reach of its end.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 event_capacity: int = 1 << 16, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, reach: int = 0, groups: tuple[int, ...] = ()):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        if reach < 0:
            raise ValueError(f"reach must be >= 0 (0: every key stays in reach), got {reach}")
        if groups and (reach or num_state_slots):
            raise ValueError("block groups (a hybrid windowed model) take no reach of the "
                             "first group and no recurrent-state slots")
        if any(r < 0 for r in groups):
            raise ValueError(f"a group's reach must be >= 0, got {groups}")
        if num_state_slots and enable_caching and num_state_snapshots < 1:
            raise ValueError("prefix caching cannot restore a recurrent state without state "
                             "snapshots: a model with linear-attention layers needs "
                             "num_state_snapshots >= 1 for it")
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end
        self._slot: dict[str, int] = {}
        # State snapshots (with caching beside a recurrent state): cached block -> the
        # snapshot of the state after it, and back, least recently used first.
        self.num_state_snapshots = num_state_snapshots if num_state_slots and enable_caching \
            else 0
        self._free_snaps = list(range(self.num_state_snapshots - 1, -1, -1))
        self._snap: dict[int, int] = {}
        self._snap_block: OrderedDict[int, int] = OrderedDict()
        self._restores: list[tuple[int, int]] = []  # (snapshot, slot): before the next step
        # Per request: the snapshot a step fills at a token count (not a block's yet), and
        # the cached block of each of its registered blocks (its own, or the one it matched).
        self._pending: dict[str, tuple[int, int, bool]] = {}
        self._cached_at: dict[str, list[int]] = {}
        # A generating request's trailing snapshot (at its latest decode boundary), and back.
        self._trailing: dict[str, int] = {}
        self._trailing_of: dict[int, str] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self.reach = reach
        self._released: dict[str, int] = {}  # per request: its leading blocks given back
        # Block groups past the first: their reaches; per request its table in each and the
        # leading pages given back; the cached pages (group -> first group's block -> page)
        # and back (page -> (group, block)).
        self.groups = tuple(groups)
        self._gtables: dict[str, list[list[int]]] = {}
        self._greleased: dict[str, list[int]] = {}
        self._shadow: list[dict[int, int]] = [{} for _ in self.groups]
        self._shadow_of: dict[int, tuple[int, int]] = {}
        # Prefix cache: key -> block, block -> (key, key id, digest); per request, how many
        # of its leading blocks are registered and the key id and digest of the last of them
        # (its chain so far). Digests (block_digest) name blocks outside this process:
        # events publishes them as blocks are cached and evicted.
        self._cached: dict[BlockKey, int] = {}
        self._block_key: dict[int, tuple[BlockKey, int, int]] = {}
        self._num_registered: dict[str, int] = {}
        self._chain: dict[str, tuple[int | str, int]] = {}
        self.events = CacheEventLog(event_capacity) if enable_caching else None
        self._next_key_id = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks not in any table (cached-but-unreferenced blocks count: they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Tokens found in the prefix cache / tokens looked up at admission (a readmitted
        request looks up its outputs so far too)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1: none, or a model without recurrent state)."""
        return self._slot.get(request_id, -1)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (the live list: read it, don't keep it)."""
        return self._tables.get(request_id, [])

    def group_tables(self, request_id: str) -> list[list[int]]:
        """The request's tables in the further block groups (live lists; [] without groups)."""
        return self._gtables.get(request_id, [])

    @property
    def releases(self) -> bool:
        """Whether requests give back pages out of reach as they grow (release_behind)."""
        return bool(self.reach or any(self.groups))

    # ---- prefix cache --------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of token_ids cached under the same salt,
        in order (whole blocks only).

        At least one token is always left out, so the caller has something to compute and
        gets next-token logits for it.
        """
        if not self.enable_caching:
            return []
        hits = self._cached_blocks(token_ids, salt)
        if self.num_state_slots:  # a recurrent state restarts only where a snapshot is
            while hits and hits[-1] not in self._snap:
                hits.pop()
        if self.groups:
            return self._group_hit(hits)
        return hits

    def _cached_blocks(self, token_ids: list[int], salt: str | None) -> list[int]:
        """The cached blocks of token_ids' longest cached prefix (whole blocks, one token
        left out), whether or not a recurrent state can restart there."""
        hits: list[int] = []
        parent = _root(salt)
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            block = self._cached.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = self._block_key[block][1]
        return hits

    def snapshot_point(self, token_ids: list[int], salt: str | None = None) -> int:
        """With state snapshots: the tokens of token_ids' longest cached prefix when no
        snapshot lies at its end (another prompt shared them and went on: a boundary
        where a snapshot would let the next such prompt restart), else 0."""
        if not self.num_state_snapshots:
            return 0
        hits = self._cached_blocks(token_ids, salt)
        return len(hits) * self.block_size if hits and hits[-1] not in self._snap else 0

    def _group_hit(self, hits: list[int]) -> PrefixHit:
        """The longest prefix of `hits` that every further group holds the pages in reach
        of (a full group: all of them), with those groups' pages."""
        n = len(hits)
        # Per group, the last position before each length whose page is not cached.
        last_miss = []
        for shadow in self._shadow:
            miss, row = -1, [-1]
            for i, b in enumerate(hits):
                if b not in shadow:
                    miss = i
                row.append(miss)
            last_miss.append(row)
        while n:
            if all(last_miss[g][n] < self._reach_start(r, n)
                   for g, r in enumerate(self.groups)):
                break
            n -= 1
        return PrefixHit(hits[:n], [[shadow.get(b, 0) for b in hits[:n]]
                                    for shadow in self._shadow])

    def _reach_start(self, reach: int, num_blocks: int) -> int:
        """The first of num_blocks whole blocks in reach of the next token (0: all)."""
        if not reach:
            return 0
        return max(0, num_blocks * self.block_size - reach) // self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int,
                          salt: str | None = None) -> None:
        """Register the request's blocks that are now full of computed tokens, under its salt.

        token_ids must hold at least the first num_computed tokens of the request.
        """
        if not self.enable_caching:
            return
        table = self._tables.get(request_id, [])
        done = self._num_registered.get(request_id, 0)
        if done < self._released.get(request_id, 0):
            return  # a block given back unregistered: nothing after it can chain on
        full = min(num_computed // self.block_size, len(table))
        bs = self.block_size
        parent, digest = self._chain.get(request_id, (_root(salt), 0))
        stored = []
        cached_at = self._cached_at.setdefault(request_id, [])
        del cached_at[done:]
        for i in range(done, full):
            block = table[i]
            entry = self._block_key.get(block)
            if entry is not None:  # shared from the cache already
                _, parent, digest = entry
                cached_at.append(block)
                continue
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = (parent, tokens)
            owner = self._cached.get(key)
            if owner is not None:
                # Another request computed the same prefix first; keep this copy private
                # (its further groups' pages join the owner where it has none).
                _, parent, digest = self._block_key[owner]
                cached_at.append(owner)
                if self.groups:
                    self._cache_pages(request_id, i, owner)
                continue
            cached_at.append(block)
            key_id = self._next_key_id
            self._next_key_id += 1
            digest = block_digest(digest, salt, tokens)
            self._cached[key] = block
            self._block_key[block] = (key, key_id, digest)
            stored.append(digest)
            parent = key_id
            if self.groups:
                self._cache_pages(request_id, i, block)
        if stored:
            self.events.stored(*stored)
        self._num_registered[request_id] = full
        self._chain[request_id] = (parent, digest)
        pending = self._pending.get(request_id)
        if pending is not None and pending[0] <= full * bs:  # its step has filled it
            del self._pending[request_id]
            num_tokens, sid, trailing = pending
            block = cached_at[num_tokens // bs - 1]
            if block in self._snap:  # (another request's got there first)
                self._free_snaps.append(sid)
            else:
                self._snap[block] = sid
                self._snap_block[sid] = block
                if trailing:
                    self._trailing[request_id] = sid
                    self._trailing_of[sid] = request_id

    def _cache_pages(self, request_id: str, index: int, block: int) -> None:
        """The request's further groups' pages at position block `index` join the cache
        under the first group's `block` (those it still holds, where the block has none)."""
        for g, (table, released) in enumerate(zip(self._gtables[request_id],
                                                  self._greleased[request_id])):
            page = table[index]
            if index >= released and block not in self._shadow[g] \
                    and page not in self._shadow_of:
                self._shadow[g][block] = page
                self._shadow_of[page] = (g, block)

    # ---- recurrent-state snapshots -------------------------------------------------------

    def reserve_snapshot(self, request_id: str, num_tokens: int,
                         trailing: bool = False) -> int | None:
        """The snapshot the request's next step fills with its state after num_tokens tokens
        (a block boundary the step reaches; the block ending there becomes the snapshot's
        when it is registered), the least recently used one taken if none is free.
        trailing (a decode step's boundary): the request's own trailing snapshot, moved from
        its previous boundary's block, or a free one, never another's: each generating
        request keeps at most one, at its latest boundary, so a conversation's next turn
        finds its answer too. None: snapshots off, not a block boundary, one pending
        already, that block has one, or (trailing) none is free."""
        bs = self.block_size
        if (not self.num_state_snapshots or request_id not in self._slot
                or request_id in self._pending or num_tokens < bs or num_tokens % bs):
            return None
        cached_at = self._cached_at.get(request_id, [])
        if len(cached_at) >= num_tokens // bs and cached_at[num_tokens // bs - 1] in self._snap:
            return None
        sid = self._trailing.pop(request_id, None) if trailing else None
        if sid is not None:  # moved on from the previous boundary's block
            del self._trailing_of[sid]
            del self._snap[self._snap_block.pop(sid)]
        elif self._free_snaps:
            sid = self._free_snaps.pop()
        elif self._snap_block and not trailing:
            sid, old = self._snap_block.popitem(last=False)
            del self._snap[old]
            self._trailing.pop(self._trailing_of.pop(sid, None), None)
        else:
            return None
        self._pending[request_id] = (num_tokens, sid, trailing)
        return sid

    def take_restores(self) -> list[tuple[int, int]]:
        """(snapshot, state slot) copies the next step needs first (admissions on a cached
        prefix), in order; cleared."""
        out, self._restores = self._restores, []
        return out

    @property
    def num_snapshots(self) -> int:
        """Snapshots held (each of one cached block)."""
        return len(self._snap)

    def prefix_pages(self, hit: list[int]) -> list[int]:
        """A cached prefix's pages (find_cached_prefix's hit) in the order another engine
        imports them (export_prefix): its blocks, then each further group's pages in reach
        of its end (the others are never read again)."""
        out = list(hit)
        for reach, pages in zip(self.groups, getattr(hit, "groups", ())):
            out += pages[self._reach_start(reach, len(hit)):]
        return out

    def prefix_rows(self, num_blocks: int) -> int:
        """How many pages prefix_pages gives for a prefix of num_blocks blocks."""
        return num_blocks + sum(num_blocks - self._reach_start(reach, num_blocks)
                                for reach in self.groups)

    def begin_import(self, key: str, token_ids: list[int], salt: str | None = None
                     ) -> tuple[list[int], list[int]] | None:
        """Pages to receive a prefix computed by another engine (disaggregated prefill),
        sent as prefix_pages orders them: token_ids fill whole blocks; the pages of its
        leading blocks already cached here are shared, the rest taken from the free queue
        under `key`, a table of its own (with block groups, a further group only takes
        pages in reach of the prefix's end). Returns (the new pages, the index of each in
        the sent pages), or None when caching is off, the model keeps a recurrent state, or
        the free blocks cannot hold it (the request then computes its prompt).
        The caller writes the new pages, then calls end_import."""
        if (not self.enable_caching or not token_ids or len(token_ids) % self.block_size
                or self.num_state_slots):  # (KV blocks alone carry no recurrent state)
            return None
        if key in self._tables:
            raise ValueError(f"{key!r} already holds blocks")
        # find_cached_prefix leaves one token out: one more makes every full block count.
        cached = self.find_cached_prefix([*token_ids, 0], salt)
        n, k = len(token_ids) // self.block_size, len(cached)
        if not self.groups:
            if not self.can_allocate(key, len(token_ids), cached):
                return None
            return self.allocate(key, len(token_ids), cached), list(range(k, n))
        # A further group's pages: the cached ones in reach of the prefix's end taken, the
        # rest in reach new; positions out of reach hold no page (given back from the start).
        starts = [self._reach_start(reach, n) for reach in self.groups]
        keep = [hit[start:k] for start, hit in zip(starts, cached.groups)]
        shared = [*cached, *(p for pages in keep for p in pages)]
        fresh = [n - k] + [n - max(start, k) for start in starts]
        if sum(fresh) + sum(1 for b in shared if self._ref[b] == 0) > len(self._free):
            return None
        for b in shared:
            self._take(b)
        new = self._pop_free(fresh[0])
        self._tables[key] = [*cached, *new]
        pages, rows = list(new), list(range(k, n))
        self._gtables[key], self._greleased[key] = [], []
        row = n
        for start, held, count, hit in zip(starts, keep, fresh[1:], cached.groups):
            got = self._pop_free(count)
            # (positions before start: any page id, as a given-back page keeps its place)
            table = [*hit[:min(start, k)], *([0] * max(0, start - k)), *held, *got]
            self._gtables[key].append(table)
            self._greleased[key].append(start)
            pages += got
            rows += range(row + max(start, k) - start, row + n - start)
            row += n - start
        if k:
            self._continue_after(key, cached)
        return pages, rows

    def end_import(self, key: str, token_ids: list[int], salt: str | None = None,
                   written: bool = True) -> None:
        """The imported blocks, written, join the prefix cache (as if a request had
        computed them, and was freed); written False (the copy failed): they are only
        freed."""
        if written:
            self.cache_full_blocks(key, token_ids, len(token_ids), salt)
        self.free(key)

    # ---- allocation ----------------------------------------------------------------------

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still needs so that its tables hold num_tokens tokens (with
        block groups: summed over the groups)."""
        nb = self.num_blocks_for(num_tokens)
        need = max(0, nb - len(self.block_table(request_id)))
        return need + sum(max(0, nb - len(t)) for t in self.group_tables(request_id))

    def num_blocks_to_take(self, request_id: str, num_tokens: int,
                           cached: list[int] = ()) -> int:
        """Free blocks that growing the tables to num_tokens tokens, starting from `cached`
        blocks (for a request that holds none yet), would take out of the free queue."""
        # Cached blocks sitting in the free queue stop being free once taken (those out
        # of reach are not taken).
        taken = sum(1 for b in cached[self._out_of_reach(len(cached)):] if self._ref[b] == 0)
        need = max(0, self.num_blocks_for(num_tokens) - len(self.block_table(request_id))
                   - len(cached))
        if self.groups:
            tables = self.group_tables(request_id) or [[] for _ in self.groups]
            pages = cached.groups if cached else [[] for _ in self.groups]
            for reach, table, hit in zip(self.groups, tables, pages):
                taken += sum(1 for p in hit[self._reach_start(reach, len(hit)):]
                             if self._ref[p] == 0)
                need += max(0, self.num_blocks_for(num_tokens) - len(table) - len(hit))
        return need + taken

    def can_allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> bool:
        """Whether the table can grow to num_tokens tokens, starting from `cached` blocks
        (for a request that holds none yet), and a request new to the pool finds a free
        state slot where the model needs one."""
        if self.num_state_slots and request_id not in self._slot and not self._free_slots:
            return False
        return self.num_blocks_to_take(request_id, num_tokens, cached) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> list[int]:
        """Grow the request's tables to hold num_tokens tokens; returns the first group's
        new block ids.

        `cached` (from find_cached_prefix, for a request with no table yet) become the
        start of its tables, shared with whoever else holds them.
        """
        if not self.can_allocate(request_id, num_tokens, cached):
            raise RuntimeError(f"out of KV blocks for {request_id!r}: "
                               f"{len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        tables = [table]
        if self.groups:
            tables += self._gtables.setdefault(request_id, [[] for _ in self.groups])
            self._greleased.setdefault(request_id, [0] * len(self.groups))
        if self.num_state_slots and request_id not in self._slot:
            self._slot[request_id] = self._free_slots.pop()
        if cached:  # every group's cached pages taken before any free one is (evicted)
            assert not table, "cached prefix blocks go into an empty table"
            skip = self._out_of_reach(len(cached))
            for b in cached[skip:]:
                self._take(b)
            table.extend(cached)
            if skip:
                self._released[request_id] = skip
            for g, (reach, pages) in enumerate(zip(self.groups, getattr(cached, "groups", ()))):
                skip = self._reach_start(reach, len(pages))
                for p in pages[skip:]:
                    self._take(p)
                tables[g + 1].extend(pages)
                self._greleased[request_id][g] = skip
            self._continue_after(request_id, cached)
            if self.num_state_slots:  # the state after the prefix, into the request's slot
                sid = self._snap[cached[-1]]
                self._snap_block.move_to_end(sid)
                self._restores.append((sid, self._slot[request_id]))
        first = None
        for t in tables:
            new = self._pop_free(self.num_blocks_for(num_tokens) - len(t))
            t.extend(new)
            first = new if first is None else first
        return first

    def _continue_after(self, request_id: str, cached: list[int]) -> None:
        """The request's table starts with the cached blocks `cached`: its registering
        (cache_full_blocks) goes on from their key chain."""
        self._num_registered[request_id] = len(cached)
        self._chain[request_id] = self._block_key[cached[-1]][1:]
        self._cached_at[request_id] = list(cached)

    def _pop_free(self, count: int) -> list[int]:
        """count blocks out of the free queue, least recently freed first (a cached one's
        prefix evicted), each held once."""
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def _out_of_reach(self, num_blocks: int) -> int:
        """How many leading blocks are out of reach of a next token right after
        num_blocks whole blocks (0 without a reach)."""
        return self._reach_start(self.reach, num_blocks)

    def release_behind(self, request_id: str, num_computed: int) -> int:
        """Give back the request's blocks wholly out of reach of its next token (position
        num_computed), in every group with a reach: no future query of it reads them.
        Registered ones stay cached until evicted; one given back before it was registered
        ends the request's registering (a later block's key chains through it; a further
        group's page just stays out of the cache). Returns how many blocks went back."""
        freed = 0
        table = self._tables.get(request_id)
        if self.reach and table:
            start = self._released.get(request_id, 0)
            end = min(max(0, num_computed - self.reach) // self.block_size, len(table) - 1)
            if end > start:
                freed += sum(self._drop(block) for block in table[start:end])
                self._released[request_id] = end
        released = self._greleased.get(request_id)
        for g, (reach, t) in enumerate(zip(self.groups, self.group_tables(request_id))):
            start = released[g]
            end = min(max(0, num_computed - reach) // self.block_size, len(t) - 1)
            if reach and end > start:
                freed += sum(self._drop(page) for page in t[start:end])
                released[g] = end
        return freed

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds (its tables less the blocks it gave back)."""
        held = len(self._tables.get(request_id, ())) - self._released.get(request_id, 0)
        released = self._greleased.get(request_id, ())
        return held + sum(len(t) - r for t, r in zip(self.group_tables(request_id), released))

    def num_to_grow(self, request_id: str, num_tokens: int, held_tokens: int | None = None,
                    step_tokens: int = 0) -> int:
        """Blocks the request would still take to hold num_tokens tokens, beyond those it
        holds (or would hold with held_tokens tokens computed); a group with a reach holds
        at most its reach and a step's tokens (step_tokens) however far it grows."""
        end = self.num_blocks_for(num_tokens)
        total = 0
        tables = [self.block_table(request_id), *self.group_tables(request_id)]
        released = [self._released.get(request_id, 0), *self._greleased.get(request_id, ())]
        reaches = (self.reach, *self.groups)
        if len(tables) < len(reaches):  # a request holding nothing yet
            tables += [[]] * (len(reaches) - len(tables))
            released += [0] * (len(reaches) - len(released))
        for reach, table, gone in zip(reaches, tables, released):
            held = len(table) if held_tokens is None else self.num_blocks_for(held_tokens)
            need = max(0, end - held)
            if reach:
                cap = self.num_blocks_for(reach + step_tokens) + 1
                now = len(table) - gone if held_tokens is None else min(held, cap)
                need = min(need, max(0, cap - now))
            total += need
        return total

    def free(self, request_id: str) -> None:
        """Drop the request's hold on its blocks (no-op if it holds none)."""
        table = self._tables.pop(request_id, [])
        del table[:self._released.pop(request_id, 0)]  # given back already
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._num_registered.pop(request_id, None)
        self._chain.pop(request_id, None)
        self._cached_at.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:  # a snapshot its step did not fill into a block
            self._free_snaps.append(pending[1])
        sid = self._trailing.pop(request_id, None)  # its last one stays, the cache's now
        if sid is not None:
            del self._trailing_of[sid]
        # Last blocks first: a prefix's tail is the least likely to be shared, so it is
        # the first to be evicted.
        for t, gone in zip(self._gtables.pop(request_id, ()),
                           self._greleased.pop(request_id, ())):
            for page in reversed(t[gone:]):
                self._drop(page)
        for block in reversed(table):
            self._drop(block)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's tables to the blocks num_tokens tokens need: the blocks
        wholly past them (speculated tokens that were rejected) go back to the pool."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        # Never drop a block the prefix cache registered for this table: those hold
        # computed tokens, which a caller rolling back rejected drafts never goes behind.
        assert keep >= self._num_registered.get(request_id, 0), "truncating computed blocks"
        for t, gone in zip([table, *self.group_tables(request_id)],
                           [self._released.get(request_id, 0),
                            *self._greleased.get(request_id, ())]):
            assert keep > gone or len(t) <= keep, "truncating blocks given back"
            while len(t) > keep:
                self._drop(t.pop())

    def _drop(self, block: int) -> bool:
        """One table's hold on the block let go; True when that was the last, the block
        then free: a cached block keeps its content until evicted (most recently freed
        last), any other is reused first (nothing worth keeping)."""
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        self._free[block] = None
        if block not in self._block_key and block not in self._shadow_of:
            self._free.move_to_end(block, last=False)
        return True

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _evict(self, block: int) -> None:
        entry = self._block_key.pop(block, None)
        if entry is not None:
            del self._cached[entry[0]]
            self.events.removed(entry[2])
            sid = self._snap.pop(block, None)
            if sid is not None:  # the state after a prefix that is gone
                del self._snap_block[sid]
                self._free_snaps.append(sid)
                self._trailing.pop(self._trailing_of.pop(sid, None), None)
            for shadow in self._shadow:  # its further groups' pages: no key reaches them
                page = shadow.pop(block, None)
                if page is not None:
                    del self._shadow_of[page]
        elif block in self._shadow_of:  # a further group's cached page
            g, owner = self._shadow_of.pop(block)
            del self._shadow[g][owner]

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def owners(self) -> dict[str, list[int]]:
        """A copy of the blocks every request holds (its tables less those it gave back;
        with block groups, each further group's after the first's), for checks and
        metrics."""
        out = {k: v[self._released.get(k, 0):] for k, v in self._tables.items()}
        for k, tables in self._gtables.items():
            for t, gone in zip(tables, self._greleased[k]):
                out[k] = out[k] + t[gone:]
        return out
