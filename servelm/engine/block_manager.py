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
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 event_capacity: int = 1 << 16, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, reach: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        if reach < 0:
            raise ValueError(f"reach must be >= 0 (0: every key stays in reach), got {reach}")
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

    # ---- prefix cache --------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of token_ids cached under the same salt,
        in order (whole blocks only).

        At least one token is always left out, so the caller has something to compute and
        gets next-token logits for it.
        """
        if not self.enable_caching:
            return []
        hits: list[int] = []
        parent = _root(salt)
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            block = self._cached.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = self._block_key[block][1]
        if self.num_state_slots:  # a recurrent state restarts only where a snapshot is
            while hits and hits[-1] not in self._snap:
                hits.pop()
        return hits

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
                # Another request computed the same prefix first; keep this copy private.
                _, parent, digest = self._block_key[owner]
                cached_at.append(owner)
                continue
            cached_at.append(block)
            key_id = self._next_key_id
            self._next_key_id += 1
            digest = block_digest(digest, salt, tokens)
            self._cached[key] = block
            self._block_key[block] = (key, key_id, digest)
            stored.append(digest)
            parent = key_id
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

    def begin_import(self, key: str, token_ids: list[int], salt: str | None = None
                     ) -> tuple[list[int], int] | None:
        """Blocks to receive a prefix computed by another engine (disaggregated prefill):
        token_ids fill whole blocks; those of its leading blocks already cached here are
        shared, the rest taken from the free queue under `key`, a table of their own.
        Returns (the new blocks, how many leading blocks were cached), or None when caching
        is off, the model keeps a recurrent state, or the free blocks cannot hold it (the
        request then computes its prompt).
        The caller writes the new blocks, then calls end_import."""
        if (not self.enable_caching or not token_ids or len(token_ids) % self.block_size
                or self.num_state_slots):  # (KV blocks alone carry no recurrent state)
            return None
        if key in self._tables:
            raise ValueError(f"{key!r} already holds blocks")
        # find_cached_prefix leaves one token out: one more makes every full block count.
        cached = self.find_cached_prefix([*token_ids, 0], salt)
        if not self.can_allocate(key, len(token_ids), cached):
            return None
        return self.allocate(key, len(token_ids), cached), len(cached)

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
        """Blocks the request still needs so that its table holds num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(self.block_table(request_id)))

    def num_blocks_to_take(self, request_id: str, num_tokens: int,
                           cached: list[int] = ()) -> int:
        """Free blocks that growing the table to num_tokens tokens, starting from `cached`
        blocks (for a request that holds none yet), would take out of the free queue."""
        # Cached blocks sitting in the free queue stop being free once taken (those out
        # of reach are not taken).
        taken = sum(1 for b in cached[self._out_of_reach(len(cached)):] if self._ref[b] == 0)
        need = max(0, self.num_blocks_for(num_tokens) - len(self.block_table(request_id))
                   - len(cached))
        return need + taken

    def can_allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> bool:
        """Whether the table can grow to num_tokens tokens, starting from `cached` blocks
        (for a request that holds none yet), and a request new to the pool finds a free
        state slot where the model needs one."""
        if self.num_state_slots and request_id not in self._slot and not self._free_slots:
            return False
        return self.num_blocks_to_take(request_id, num_tokens, cached) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> list[int]:
        """Grow the request's table to hold num_tokens tokens; returns the new block ids.

        `cached` (from find_cached_prefix, for a request with no table yet) become the
        start of its table, shared with whoever else holds them.
        """
        if not self.can_allocate(request_id, num_tokens, cached):
            raise RuntimeError(f"out of KV blocks for {request_id!r}: "
                               f"{len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        if self.num_state_slots and request_id not in self._slot:
            self._slot[request_id] = self._free_slots.pop()
        if cached:
            assert not table, "cached prefix blocks go into an empty table"
            skip = self._out_of_reach(len(cached))
            for b in cached[skip:]:
                self._take(b)
            table.extend(cached)
            if skip:
                self._released[request_id] = skip
            self._num_registered[request_id] = len(cached)
            self._chain[request_id] = self._block_key[cached[-1]][1:]
            self._cached_at[request_id] = list(cached)
            if self.num_state_slots:  # the state after the prefix, into the request's slot
                sid = self._snap[cached[-1]]
                self._snap_block.move_to_end(sid)
                self._restores.append((sid, self._slot[request_id]))
        new = []
        for _ in range(self.num_blocks_for(num_tokens) - len(table)):
            block, _ = self._free.popitem(last=False)  # least recently freed first
            self._evict(block)
            self._ref[block] = 1
            new.append(block)
        table.extend(new)
        return new

    def _out_of_reach(self, num_blocks: int) -> int:
        """How many leading blocks are out of reach of a next token right after
        num_blocks whole blocks (0 without a reach)."""
        if not self.reach:
            return 0
        return max(0, num_blocks * self.block_size - self.reach) // self.block_size

    def release_behind(self, request_id: str, num_computed: int) -> int:
        """Give back the request's blocks wholly out of reach of its next token (position
        num_computed): no future query of it reads them. Registered ones stay cached until
        evicted; one given back before it was registered ends the request's registering
        (a later block's key chains through it). Returns how many blocks went back."""
        table = self._tables.get(request_id)
        if not self.reach or not table:
            return 0
        start = self._released.get(request_id, 0)
        end = min(max(0, num_computed - self.reach) // self.block_size, len(table) - 1)
        if end <= start:
            return 0
        freed = sum(self._drop(block) for block in table[start:end])
        self._released[request_id] = end
        return freed

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds (its table less the blocks it gave back)."""
        return len(self._tables.get(request_id, ())) - self._released.get(request_id, 0)

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
        for block in reversed(table):
            self._drop(block)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks num_tokens tokens need: the blocks
        wholly past them (speculated tokens that were rejected) go back to the pool."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        # Never drop a block the prefix cache registered for this table: those hold
        # computed tokens, which a caller rolling back rejected drafts never goes behind.
        assert keep >= self._num_registered.get(request_id, 0), "truncating computed blocks"
        while len(table) > keep:
            self._drop(table.pop())

    def _drop(self, block: int) -> bool:
        """One table's hold on the block let go; True when that was the last, the block
        then free: a cached block keeps its content until evicted (most recently freed
        last), any other is reused first (nothing worth keeping)."""
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        self._free[block] = None
        if block not in self._block_key:
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

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def owners(self) -> dict[str, list[int]]:
        """A copy of the blocks every request holds (its table less those it gave back),
        for checks and metrics."""
        return {k: v[self._released.get(k, 0):] for k, v in self._tables.items()}
