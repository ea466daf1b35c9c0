"""BlockManager tests: paged KV block bookkeeping, unit cases plus a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from servelm.engine.block_manager import BlockManager


def free_block_ids(bm: BlockManager) -> list[int]:
    """The free list's ids, through the public API only.

    A probe request takes every free block and gives them straight back; since it takes them
    all, the free list is left exactly as it was.
    """
    probe = "__probe__"
    assert probe not in bm.owners()
    n = bm.num_free_blocks
    ids = bm.allocate(probe, n * bm.block_size)
    assert len(ids) == n
    assert bm.num_free_blocks == 0
    bm.free(probe)
    assert bm.num_free_blocks == n
    return ids


def check_pool(bm: BlockManager) -> None:
    """Every block id is either free or in exactly one table; nothing lost, nothing doubled."""
    owned = [b for table in bm.owners().values() for b in table]
    free = free_block_ids(bm)
    assert len(owned) == len(set(owned)), f"a block is owned twice: {sorted(owned)}"
    assert len(free) == len(set(free)), f"a block is free twice: {sorted(free)}"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert sorted(owned + free) == list(range(bm.num_blocks))
    assert bm.num_free_blocks + len(owned) == bm.num_blocks


# ---- unit tests ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4), (4, -2)])
def test_rejects_empty_pool_or_block(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


@pytest.mark.parametrize("block_size, tokens, blocks", [
    (4, 0, 0), (4, 1, 1), (4, 3, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3),
    (1, 0, 0), (1, 1, 1), (1, 7, 7), (16, 15, 1), (16, 16, 1), (16, 17, 2), (16, 100, 7),
])
def test_num_blocks_for_rounds_up(block_size, tokens, blocks):
    assert BlockManager(8, block_size).num_blocks_for(tokens) == blocks


def test_fresh_pool_is_all_free():
    bm = BlockManager(10, 4)
    assert bm.num_free_blocks == 10
    assert bm.usage == 0.0
    assert bm.owners() == {}
    assert bm.block_table("nobody") == []
    check_pool(bm)


def test_allocate_grows_table_by_whole_blocks():
    bm = BlockManager(10, 4)
    first = bm.allocate("a", 1)
    assert len(first) == 1
    assert bm.block_table("a") == first
    # Still inside the first block: nothing new.
    assert bm.allocate("a", 4) == []
    assert bm.block_table("a") == first
    assert bm.num_free_blocks == 9
    # One token over the block boundary takes exactly one more block.
    second = bm.allocate("a", 5)
    assert len(second) == 1
    assert bm.block_table("a") == first + second
    # Jumping ahead several blocks at once takes them all, appended in order.
    more = bm.allocate("a", 17)  # 5 blocks in all
    assert len(more) == 3
    assert bm.block_table("a") == first + second + more
    assert len(set(bm.block_table("a"))) == 5
    assert bm.num_free_blocks == 5
    # Asking for fewer tokens than held never shrinks the table.
    assert bm.allocate("a", 2) == []
    assert len(bm.block_table("a")) == 5
    check_pool(bm)


def test_tables_of_different_requests_are_disjoint():
    bm = BlockManager(12, 2)
    a = bm.allocate("a", 5)  # 3 blocks
    b = bm.allocate("b", 4)  # 2 blocks
    a += bm.allocate("a", 8)  # +1
    assert len(a) == 4 and len(b) == 2
    assert not set(a) & set(b)
    assert bm.owners() == {"a": a, "b": b}
    assert bm.num_free_blocks == 6
    check_pool(bm)


def test_num_new_blocks():
    bm = BlockManager(10, 4)
    assert bm.num_new_blocks("a", 9) == 3
    bm.allocate("a", 6)
    assert bm.num_new_blocks("a", 6) == 0
    assert bm.num_new_blocks("a", 8) == 0
    assert bm.num_new_blocks("a", 9) == 1
    assert bm.num_new_blocks("a", 1) == 0  # never negative


def test_can_allocate_false_when_pool_short():
    bm = BlockManager(4, 4)
    assert bm.can_allocate("a", 16)
    assert not bm.can_allocate("a", 17)
    bm.allocate("a", 12)  # 3 blocks, 1 free
    assert bm.can_allocate("b", 4)
    assert not bm.can_allocate("b", 5)
    # What counts is the growth beyond the table already held.
    assert bm.can_allocate("a", 16)
    assert not bm.can_allocate("a", 17)
    assert bm.can_allocate("a", 3)


def test_allocate_raises_when_short_and_changes_nothing():
    bm = BlockManager(4, 4)
    a = bm.allocate("a", 12)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate("b", 5)
    # The failed call took nothing: not even a partial table for b.
    assert bm.num_free_blocks == 1
    assert bm.block_table("b") == []
    assert bm.owners() == {"a": a}
    with pytest.raises(RuntimeError):
        bm.allocate("a", 17)
    assert bm.block_table("a") == a
    assert bm.num_free_blocks == 1
    check_pool(bm)
    # The last free block is still usable.
    assert len(bm.allocate("b", 4)) == 1
    assert bm.num_free_blocks == 0


def test_free_returns_everything():
    bm = BlockManager(8, 2)
    a = bm.allocate("a", 7)  # 4 blocks
    b = bm.allocate("b", 3)  # 2 blocks
    assert bm.num_free_blocks == 2
    bm.free("a")
    assert bm.num_free_blocks == 6
    assert bm.block_table("a") == []
    assert "a" not in bm.owners()
    assert bm.owners() == {"b": b}
    check_pool(bm)
    # a's blocks are reusable: a new request can take the whole rest of the pool.
    c = bm.allocate("c", 12)
    assert len(c) == 6
    assert set(a) <= set(c)
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 8
    assert bm.owners() == {}
    check_pool(bm)


def test_free_of_unknown_id_is_noop():
    bm = BlockManager(6, 4)
    a = bm.allocate("a", 9)
    bm.free("nobody")
    bm.free("a")
    bm.free("a")  # twice: the second is a no-op, nothing freed twice
    assert bm.num_free_blocks == 6
    assert bm.owners() == {}
    check_pool(bm)
    assert len(a) == 3


def test_usage_fraction():
    bm = BlockManager(8, 4)
    assert bm.usage == pytest.approx(0.0)
    bm.allocate("a", 4)
    assert bm.usage == pytest.approx(1 / 8)
    bm.allocate("b", 12)
    assert bm.usage == pytest.approx(4 / 8)
    bm.allocate("a", 20)
    assert bm.usage == pytest.approx(8 / 8)
    bm.free("b")
    assert bm.usage == pytest.approx(5 / 8)
    bm.free("a")
    assert bm.usage == pytest.approx(0.0)


def test_owners_is_a_copy():
    bm = BlockManager(4, 4)
    bm.allocate("a", 4)
    owners = bm.owners()
    owners["a"].append(99)
    owners["b"] = [0]
    assert bm.owners() == {"a": bm.block_table("a")}
    assert len(bm.block_table("a")) == 1


def test_a_windowed_model_gives_back_the_blocks_out_of_reach_and_keeps_their_places():
    bm = BlockManager(4, 4, reach=6)
    bm.allocate("a", 15)                    # positions 0..14: blocks 0-3
    table = list(bm.block_table("a"))
    # The next token (position 14) reads keys 9..14: blocks 0 and 1 are out of reach.
    assert bm.release_behind("a", 14) == 2
    assert bm.block_table("a") == table and bm.owners() == {"a": table[2:]}
    assert bm.num_held("a") == 2 and bm.num_free_blocks == 2
    assert bm.release_behind("a", 14) == 0   # once only
    bm.allocate("b", 8)                      # into the blocks "a" gave back
    assert sorted(bm.block_table("b")) == sorted(table[:2])
    bm.free("a")
    assert bm.owners() == {"b": bm.block_table("b")} and bm.num_free_blocks == 2
    with pytest.raises(ValueError, match="reach"):
        BlockManager(4, 4, reach=-1)


def test_without_a_reach_every_block_stays():
    bm = BlockManager(4, 4)
    bm.allocate("a", 16)
    assert bm.release_behind("a", 16) == 0 and bm.num_held("a") == 4


def test_a_windowed_prefix_hit_holds_only_the_blocks_in_reach():
    bm = BlockManager(6, 2, enable_caching=True, reach=3)
    tokens = list(range(9))
    admit(bm, "a", tokens)
    assert bm.release_behind("a", 9) == 3   # keys 6..8 stay: blocks 3 and 4
    bm.free("a")
    hits = bm.find_cached_prefix(tokens)
    assert len(hits) == 4                    # every block stays cached until evicted
    # The next token (position 8) reads keys 6..8: only hits 2 and 3 are held.
    assert bm.num_blocks_to_take("b", 9, hits) == 3
    bm.allocate("b", 9, hits)
    assert bm.owners()["b"] == bm.block_table("b")[2:]
    assert [bm.ref_count(b) for b in hits] == [0, 0, 1, 1]


# ---- property tests -------------------------------------------------------------------------

REQUEST_IDS = ["r0", "r1", "r2", "r3", "r4"]

op = st.one_of(
    st.tuples(st.just("grow"), st.sampled_from(REQUEST_IDS), st.integers(0, 40)),
    st.tuples(st.just("free"), st.sampled_from(REQUEST_IDS), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]),
       ops=st.lists(op, max_size=60))
def test_random_allocate_free_sequences(num_blocks, block_size, ops):
    """Random table growth and frees against a model of how many tokens each request holds."""
    bm = BlockManager(num_blocks, block_size)
    held: dict[str, int] = {}  # request -> tokens its table must cover
    for kind, rid, extra in ops:
        before = list(bm.block_table(rid))
        free_before = bm.num_free_blocks
        if kind == "grow":
            target = held.get(rid, 0) + extra
            need = bm.num_blocks_for(target) - len(before)
            assert bm.num_new_blocks(rid, target) == max(0, need)
            assert bm.can_allocate(rid, target) == (need <= free_before)
            if need <= free_before:
                new = bm.allocate(rid, target)
                assert len(new) == max(0, need)
                assert bm.block_table(rid) == before + new
                assert bm.num_free_blocks == free_before - len(new)
                held[rid] = target
            else:
                with pytest.raises(RuntimeError):
                    bm.allocate(rid, target)
                assert bm.block_table(rid) == before
                assert bm.num_free_blocks == free_before
        else:
            bm.free(rid)
            assert bm.block_table(rid) == []
            assert bm.num_free_blocks == free_before + len(before)
            held.pop(rid, None)
        for r in REQUEST_IDS:
            assert len(bm.block_table(r)) == bm.num_blocks_for(held.get(r, 0))
        assert bm.usage == pytest.approx(1 - bm.num_free_blocks / num_blocks)
        check_pool(bm)
    for rid in REQUEST_IDS:
        bm.free(rid)
    assert bm.num_free_blocks == num_blocks
    assert bm.owners() == {}
    check_pool(bm)


class BlockManagerMachine(RuleBasedStateMachine):
    """Stateful: grow and free tables of several requests over pools of varying size."""

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[str, int] = {}

    @initialize(num_blocks=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4, 8]))
    def make_pool(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.tokens = {}

    @rule(rid=st.sampled_from(REQUEST_IDS), extra=st.integers(1, 20))
    def grow_if_room(self, rid, extra):
        bm = self.bm
        target = self.tokens.get(rid, 0) + extra
        before = list(bm.block_table(rid))
        free = bm.num_free_blocks
        if bm.can_allocate(rid, target):
            new = bm.allocate(rid, target)
            assert len(before) + len(new) == bm.num_blocks_for(target)
            assert bm.num_free_blocks == free - len(new)
            self.tokens[rid] = target
        else:
            assert bm.num_blocks_for(target) - len(before) > free
            with pytest.raises(RuntimeError):
                bm.allocate(rid, target)
            assert bm.block_table(rid) == before
            assert bm.num_free_blocks == free

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        held = len(self.bm.block_table(rid))
        free = self.bm.num_free_blocks
        self.bm.free(rid)
        assert self.bm.num_free_blocks == free + held
        self.tokens.pop(rid, None)

    @precondition(lambda self: self.bm is not None)
    @rule()
    def free_everyone_then_refill(self):
        for rid in REQUEST_IDS:
            self.bm.free(rid)
        self.tokens = {}
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.usage == 0.0
        # The whole pool is usable again by one request.
        whole = self.bm.allocate("r0", self.bm.num_blocks * self.bm.block_size)
        assert sorted(whole) == list(range(self.bm.num_blocks))
        self.tokens["r0"] = self.bm.num_blocks * self.bm.block_size

    @invariant()
    def tables_match_model(self):
        if self.bm is None:
            return
        for rid in REQUEST_IDS:
            assert len(self.bm.block_table(rid)) == self.bm.num_blocks_for(self.tokens.get(rid, 0))

    @invariant()
    def pool_consistent(self):
        if self.bm is not None:
            check_pool(self.bm)

    def teardown(self):
        if self.bm is None:
            return
        for rid in REQUEST_IDS:
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.owners() == {}


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- prefix caching: unit tests -------------------------------------------------------------

def cached_bm(num_blocks: int, block_size: int) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_caching=True)


def admit(bm: BlockManager, rid: str, tokens: list[int], compute: int | None = None,
          salt: str | None = None) -> list[int]:
    """What the scheduler does: look up the prefix, allocate from it, compute, register.

    Computes `compute` tokens (all of them by default) and returns the cached blocks found.
    """
    cached = bm.find_cached_prefix(tokens, salt)
    end = len(tokens) if compute is None else compute
    bm.allocate(rid, end, cached)
    bm.cache_full_blocks(rid, tokens[:end], end, salt)
    return cached


def check_refs(bm: BlockManager) -> None:
    """Caching-safe pool check (no probe allocation: that would evict the cache)."""
    owners = bm.owners()
    for table in owners.values():
        assert len(table) == len(set(table)), f"a block twice in one table: {table}"
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == sum(b in t for t in owners.values()), f"block {b}"
    assert bm.num_free_blocks == sum(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_caching_off_never_hits():
    bm = BlockManager(8, 2)
    tokens = list(range(7))
    admit(bm, "a", tokens)
    assert bm.find_cached_prefix(tokens) == []
    bm.free("a")
    assert bm.find_cached_prefix(tokens) == []
    assert bm.hit_rate == 0.0


def test_same_prompt_shares_full_blocks_but_not_the_partial_one():
    bm = cached_bm(10, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert admit(bm, "a", prompt) == []
    a = bm.block_table("a")
    assert len(a) == 3
    hits = bm.find_cached_prefix(prompt)
    assert hits == a[:2]
    bm.allocate("b", len(prompt), hits)
    b = bm.block_table("b")
    assert b[:2] == a[:2]
    assert b[2] != a[2]  # the partial last block is never shared
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]
    assert bm.ref_count(b[2]) == 1
    assert bm.num_free_blocks == 10 - 4
    check_refs(bm)
    # Longer prompts with the same start hit the same blocks; a partial block is no hit.
    assert bm.find_cached_prefix(prompt + [1, 2, 3]) == a[:2]
    assert bm.find_cached_prefix(prompt[:8]) == a[:1]  # one token always left over
    assert bm.find_cached_prefix(prompt[:5]) == a[:1]
    assert bm.find_cached_prefix(prompt[:4]) == []
    bm.record_lookup(10, 8)
    bm.record_lookup(10, 0)
    assert bm.hit_rate == pytest.approx(0.4)
    bm.free("a")
    # a's shared blocks are still held by b; only its private partial block is free.
    assert [bm.ref_count(x) for x in a] == [1, 1, 0]
    assert bm.num_free_blocks == 10 - 3
    check_refs(bm)
    bm.free("b")
    assert bm.num_free_blocks == 10
    check_refs(bm)


def test_a_salt_is_a_prefix_cache_of_its_own():
    """Same tokens under another salt are no hit (so cached_tokens cannot tell one tenant
    what another sent); under the same salt they are, from the first block on."""
    bm = cached_bm(16, 4)
    prompt = list(range(10))  # 2 full blocks + 2
    assert admit(bm, "plain", prompt) == []
    assert admit(bm, "a1", prompt, salt="a") == []
    a1 = bm.block_table("a1")
    assert admit(bm, "a2", prompt, salt="a") == a1[:2]
    assert bm.find_cached_prefix(prompt, "b") == []
    assert bm.find_cached_prefix(prompt) == bm.block_table("plain")[:2]
    # A salt that looks like a key id or the unsalted root aliases nothing either.
    assert bm.find_cached_prefix(prompt, "-1") == [] and bm.find_cached_prefix(prompt, "0") == []
    for rid in ("plain", "a1", "a2"):
        bm.free(rid)
    check_refs(bm)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_prompt_of_whole_blocks_leaves_its_last_block_to_compute(block_size):
    bm = cached_bm(16, block_size)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 0, 11][:3 * block_size]  # exactly 3 blocks
    admit(bm, "a", prompt)
    a = bm.block_table("a")
    assert len(a) == 3
    hits = bm.find_cached_prefix(prompt)
    assert hits == a[:2]  # not all three: the last token must still be computed
    assert len(prompt) - len(hits) * block_size == block_size >= 1
    assert bm.find_cached_prefix(prompt + [0]) == a  # one more token: all three hit
    assert bm.find_cached_prefix(prompt[:1]) == []
    assert bm.find_cached_prefix([]) == []


def test_diverging_prompts_share_only_the_blocks_before_the_divergence():
    bm = cached_bm(16, 2)
    a_tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b_tokens = [1, 2, 3, 4, 5, 0, 7, 8, 9]  # differs inside the third block
    admit(bm, "a", a_tokens)
    a = bm.block_table("a")
    hits = admit(bm, "b", b_tokens)
    assert hits == a[:2]
    b = bm.block_table("b")
    assert not set(b[2:]) & set(a)
    # b registered its own third and fourth blocks, chained after the shared two.
    assert bm.find_cached_prefix(b_tokens + [0]) == b[:4]
    assert bm.find_cached_prefix(a_tokens + [0]) == a[:4]
    # A third prompt following b's branch and then a's tokens again hits b's branch only.
    c_tokens = [1, 2, 3, 4, 5, 0, 7, 8, 9, 9, 9]
    assert bm.find_cached_prefix(c_tokens) == b[:4]
    check_refs(bm)


def test_chain_key_same_block_elsewhere_is_no_hit():
    bm = cached_bm(16, 4)
    admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    a = bm.block_table("a")
    # The same tokens [5..8] at position 0, or after a different first block: no hit.
    assert bm.find_cached_prefix([5, 6, 7, 8, 0]) == []
    assert bm.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]) == []
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == a[:2]
    # A request whose second block has a's second block's tokens after other history
    # registers its own block; lookups follow each one's own chain.
    admit(bm, "b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    b = bm.block_table("b")
    assert not set(b) & set(a)
    assert bm.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 1]) == b[:2]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]) == a[:2]
    # Repeated blocks inside one prompt are different positions, so different keys.
    admit(bm, "c", [4, 4, 4, 4, 4, 4, 4, 4, 4])
    c = bm.block_table("c")
    assert len(set(c)) == 3
    assert bm.find_cached_prefix([4] * 9) == c[:2]
    assert bm.find_cached_prefix([4] * 5) == c[:1]
    check_refs(bm)


def test_freed_cached_blocks_stay_hits_until_evicted():
    bm = cached_bm(8, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(bm, "a", prompt)
    a = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 8  # cached but unreferenced blocks count as free
    assert all(bm.ref_count(x) == 0 for x in a)
    assert bm.find_cached_prefix(prompt) == a[:2]
    # Taking them back out of the free queue: they are referenced again, not free.
    hits = admit(bm, "b", prompt)
    assert hits == a[:2]
    assert bm.block_table("b")[:2] == a[:2]
    assert [bm.ref_count(x) for x in a[:2]] == [1, 1]
    assert bm.num_free_blocks == 8 - 3
    check_refs(bm)
    bm.free("b")
    # Fill the pool with other work: the cached prefix is gone only once the pool needs it.
    bm.allocate("x", 8 * 2)
    assert bm.find_cached_prefix(prompt) == []
    bm.free("x")
    assert bm.find_cached_prefix(prompt) == []
    check_refs(bm)


def test_eviction_only_when_uncached_blocks_run_out_least_recently_freed_first():
    bm = cached_bm(8, 2)
    pa = [1, 1, 2, 2, 3]   # two cached blocks + one private partial
    pb = [7, 7, 8, 8, 9]
    admit(bm, "a", pa)
    a = bm.block_table("a")
    admit(bm, "b", pb)
    b = bm.block_table("b")
    bm.free("a")   # a's blocks freed first: evicted first
    bm.free("b")
    # 8 free: 4 cached (a0, a1, b0, b1) and 4 without a prefix worth keeping.
    assert bm.num_free_blocks == 8
    uncached = set(range(8)) - set(a[:2]) - set(b[:2])
    got = bm.allocate("x", 4 * 2)
    assert set(got) == uncached  # no eviction while uncached blocks are free
    assert bm.find_cached_prefix(pa) == a[:2]
    assert bm.find_cached_prefix(pb) == b[:2]
    # One more block: a's, the least recently freed; and a's tail before its head.
    got = bm.allocate("y", 2)
    assert got == [a[1]]
    assert bm.find_cached_prefix(pa) == a[:1]
    assert bm.find_cached_prefix(pb) == b[:2]
    got = bm.allocate("y", 4)
    assert got == [a[0]]
    assert bm.find_cached_prefix(pa) == []
    assert bm.find_cached_prefix(pb) == b[:2]
    got = bm.allocate("y", 6)
    assert got == [b[1]]
    assert bm.find_cached_prefix(pb) == b[:1]
    check_refs(bm)


def test_reusing_a_cached_block_makes_it_recently_used():
    bm = cached_bm(4, 2)
    pa, pb = [1, 1, 0], [2, 2, 0]
    admit(bm, "a", pa)
    a0 = bm.block_table("a")[0]
    admit(bm, "b", pb)
    b0 = bm.block_table("b")[0]
    bm.free("a")
    bm.free("b")
    # a is used again (a hit) and freed after b: now b's block is the older one.
    assert admit(bm, "a2", pa) == [a0]
    bm.free("a2")
    assert bm.allocate("x", 2 * 2) and bm.num_free_blocks == 2  # the two uncached ones
    assert bm.allocate("y", 2) == [b0]
    assert bm.find_cached_prefix(pa) == [a0]
    assert bm.find_cached_prefix(pb) == []


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    bm = cached_bm(3, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(bm, "a", prompt)  # takes the whole pool
    a = bm.block_table("a")
    bm.free("a")
    assert bm.allocate("x", 2) == [a[2]]  # the private partial block, not a cached one
    assert bm.find_cached_prefix(prompt) == a[:2]
    # A private duplicate (computed while the prefix was already cached) is not kept either.
    bm.free("x")
    bm.allocate("p", 5)  # 3 blocks, no lookup: a's cached ones get evicted
    assert bm.find_cached_prefix(prompt) == []
    bm.free("p")
    bm2 = cached_bm(6, 2)
    admit(bm2, "a", prompt)
    bm2.allocate("d", 5)            # computed the same prompt without a lookup
    bm2.cache_full_blocks("d", prompt, 5)
    d = bm2.block_table("d")
    a = bm2.block_table("a")
    assert bm2.find_cached_prefix(prompt) == a[:2]  # the first copy stays the cached one
    bm2.free("a")
    bm2.free("d")
    # d's blocks are all private (its two full ones duplicate a's): reused first.
    got = bm2.allocate("x", 6)
    assert set(got) == set(d)
    assert bm2.find_cached_prefix(prompt) == a[:2]
    check_refs(bm2)


def test_can_allocate_counts_cached_blocks_taken_from_the_free_queue():
    bm = cached_bm(4, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(bm, "a", prompt)
    a = bm.block_table("a")
    bm.free("a")
    hits = bm.find_cached_prefix(prompt)
    assert hits == a[:2]
    # The two hit blocks are in the free queue: taking them leaves 2 free blocks, not 4.
    assert bm.can_allocate("b", 8, hits)       # 2 hits + 2 new = 4
    assert not bm.can_allocate("b", 9, hits)   # 2 hits + 3 new = 5 > 4
    with pytest.raises(RuntimeError):
        bm.allocate("b", 9, hits)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 4
    assert all(bm.ref_count(x) == 0 for x in range(4))
    assert bm.find_cached_prefix(prompt) == hits  # the failed call evicted nothing
    new = bm.allocate("b", 8, hits)
    assert len(new) == 2 and not set(new) & set(hits)
    assert bm.block_table("b") == hits + new
    assert bm.num_free_blocks == 0
    check_refs(bm)


def test_can_allocate_with_hits_held_by_a_running_request():
    bm = cached_bm(4, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(bm, "a", prompt)  # 3 blocks held, 1 free
    hits = bm.find_cached_prefix(prompt)
    assert len(hits) == 2
    # The hits are not free blocks: sharing them costs nothing.
    assert bm.can_allocate("b", 5, hits)      # 1 new
    assert not bm.can_allocate("b", 7, hits)  # 2 new > 1 free
    assert not bm.can_allocate("b", 5)        # without the hits: 3 new > 1 free
    bm.allocate("b", 5, hits)
    assert bm.num_free_blocks == 0
    assert [bm.ref_count(x) for x in hits] == [2, 2]
    check_refs(bm)


def test_duplicate_blocks_stay_private_and_later_blocks_still_register():
    bm = cached_bm(16, 2)
    shared = [1, 2, 3, 4]
    # a and b compute the same prefix at the same time (neither found it in the cache).
    bm.allocate("a", 5)
    bm.allocate("b", 5)
    a_tokens = shared + [5, 6, 7]
    b_tokens = shared + [8, 9, 9]
    bm.cache_full_blocks("a", a_tokens[:5], 5)
    a = bm.block_table("a")
    # b registers one block at a time, first its two duplicates, then new ones after them
    # (this used to crash).
    bm.cache_full_blocks("b", b_tokens[:2], 2)
    bm.cache_full_blocks("b", b_tokens[:5], 5)
    b = bm.block_table("b")
    assert bm.find_cached_prefix(shared + [0]) == a[:2]
    bm.allocate("b", 7)
    b = bm.block_table("b")
    bm.cache_full_blocks("b", b_tokens, 6)
    bm.allocate("b", 8)
    bm.cache_full_blocks("b", b_tokens + [0], 8)
    b = bm.block_table("b")
    # b's third block is registered after a's chain: a lookup mixes a's and b's blocks.
    assert bm.find_cached_prefix(b_tokens + [0, 1]) == a[:2] + b[2:4]
    assert bm.find_cached_prefix(b_tokens + [0]) == a[:2] + b[2:3]
    assert [bm.ref_count(x) for x in a + b] == [1] * (len(a) + len(b))
    check_refs(bm)
    # a's third block registers too (its own chain), and b's duplicates never became hits.
    bm.allocate("a", 7)
    bm.cache_full_blocks("a", a_tokens, 6)
    assert bm.find_cached_prefix(a_tokens) == a[:3]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16
    # b's private duplicates go first; the chain through a's blocks still works.
    got = bm.allocate("x", 2 * 2)
    assert set(got) == set(b[:2])
    assert bm.find_cached_prefix(b_tokens + [0, 1]) == a[:2] + b[2:4]
    check_refs(bm)


def test_duplicate_of_a_cached_prefix_then_eviction_of_both():
    """A private duplicate and the cached original must be evictable in any order."""
    for first in ("a", "b"):
        bm = cached_bm(4, 2)
        bm.allocate("a", 3)
        bm.allocate("b", 3)
        bm.cache_full_blocks("a", [1, 2, 3], 3)
        bm.cache_full_blocks("b", [1, 2, 4], 3)
        bm.free(first)
        bm.free("b" if first == "a" else "a")
        bm.allocate("x", 8)  # evicts everything
        assert bm.find_cached_prefix([1, 2, 3]) == []
        bm.free("x")
        admit(bm, "c", [1, 2, 3])
        c = bm.block_table("c")
        assert bm.find_cached_prefix([1, 2, 5]) == c[:1]
        check_refs(bm)


def test_partial_blocks_are_not_registered_until_full():
    bm = cached_bm(8, 4)
    prompt = list(range(10, 20))
    bm.allocate("a", 6)
    bm.cache_full_blocks("a", prompt[:6], 6)  # block 0 full, block 1 half
    a = bm.block_table("a")
    assert bm.find_cached_prefix(prompt) == a[:1]
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", prompt[:7], 7)   # still only one full block
    assert bm.find_cached_prefix(prompt) == a[:1]
    bm.cache_full_blocks("a", prompt[:10], 10)
    assert bm.find_cached_prefix(prompt) == bm.block_table("a")[:2]


# ---- prefix caching: stateful property test -------------------------------------------------

# Prompts start with one of a few shared prefixes (so lookups hit) and go on with tokens from a
# tiny alphabet (so different requests often agree on whole blocks, and the same block of
# tokens turns up at different positions and after different histories).
PREFIXES = [
    [],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 2, 2, 2, 2],
    [2, 2, 2, 2, 1, 1, 1, 1],
    [0, 1, 2, 0, 1, 2, 0, 1, 2],
]
CACHE_IDS = ["c0", "c1", "c2", "c3"]
tail_tokens = st.lists(st.integers(0, 2), max_size=7)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests look up, share, compute, register and free blocks, against a fake KV store.

    The fake KV store maps (block, offset) to the whole token prefix up to and including the
    token computed there: what a real KV entry depends on. A block handed out by
    find_cached_prefix must hold exactly the prefix asked for, and a request's own computed
    positions must never change under it.
    """

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[str, list[int]] = {}   # admitted requests' tokens (known so far)
        self.computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.hits = 0
        self.seen: list[tuple[int, ...]] = []

    @initialize(num_blocks=st.one_of(st.integers(1, 6), st.integers(6, 24)),
                block_size=st.sampled_from([1, 2, 3, 4]),
                reach=st.sampled_from([0, 0, 1, 2, 3, 5, 8]))
    def make_pool(self, num_blocks, block_size, reach):
        # reach > 0: a windowed model, whose blocks out of reach go back as it computes
        self.bm = BlockManager(num_blocks, block_size, enable_caching=True, reach=reach)

    def check_hits(self, tokens: list[int], hits: list[int]) -> None:
        bs = self.bm.block_size
        assert len(hits) * bs <= max(0, len(tokens) - 1), "no token left to compute"
        assert len(set(hits)) == len(hits)
        for i, b in enumerate(hits):
            for j in range(bs):
                pos = i * bs + j
                assert self.kv.get((b, j)) == tuple(tokens[:pos + 1]), \
                    f"cached block {b} does not hold the prefix up to position {pos}"

    def compute(self, rid: str, end: int) -> None:
        """The forward pass: write positions [computed, end) into the request's blocks."""
        bs = self.bm.block_size
        table = self.bm.block_table(rid)
        tokens = self.tokens[rid]
        held = set(self.bm.owners()[rid])
        for pos in range(self.computed[rid], end):
            b = table[pos // bs]
            assert self.bm.ref_count(b) == 1, f"writing into shared block {b}"
            assert b in held, f"writing into block {b}, given back"
            self.kv[(b, pos % bs)] = tuple(tokens[:pos + 1])
        self.computed[rid] = end

    @precondition(lambda self: len(self.tokens) < len(CACHE_IDS))
    @rule(data=st.data(), prefix=st.sampled_from(range(len(PREFIXES))),
          tail=tail_tokens, frac=st.floats(0, 1),
          register=st.sampled_from([True, True, True, False]))
    def admit(self, data, prefix, tail, frac, register):
        bm = self.bm
        rid = data.draw(st.sampled_from([r for r in CACHE_IDS if r not in self.tokens]))
        # Often the very tokens of an earlier request (n > 1 samples, a retried prompt).
        if self.seen and data.draw(st.booleans()):
            tokens = list(data.draw(st.sampled_from(self.seen)))
        else:
            tokens = PREFIXES[prefix] + tail
        if not tokens:
            return
        hits = bm.find_cached_prefix(tokens)
        self.check_hits(tokens, hits)
        self.hits += bool(hits)
        start = len(hits) * bm.block_size
        end = start + 1 + int(frac * (len(tokens) - start - 1))
        refs = [bm.ref_count(b) for b in hits]
        free = bm.num_free_blocks
        # Hits wholly out of reach of the first token to compute are not held.
        skip = max(0, start - bm.reach) // bm.block_size if bm.reach else 0
        taken = sum(r == 0 for r in refs[skip:])
        new = bm.num_blocks_for(end) - len(hits)
        fits = new + taken <= free
        assert bm.can_allocate(rid, end, hits) == fits
        if not fits:
            with pytest.raises(RuntimeError):
                bm.allocate(rid, end, hits)
            assert bm.block_table(rid) == [] and bm.num_free_blocks == free
            assert [bm.ref_count(b) for b in hits] == refs
            return
        got = bm.allocate(rid, end, hits)
        table = bm.block_table(rid)
        assert table == hits + got and len(got) == new
        # (A hit not held may be evicted and handed out again at once: the table keeps
        # its place, masked, all the same.)
        assert [bm.ref_count(b) for b in hits[skip:]] == [r + 1 for r in refs[skip:]]
        assert bm.owners()[rid] == table[skip:]
        assert bm.num_free_blocks == free - new - taken
        self.tokens[rid] = tokens
        self.seen.append(tuple(tokens))
        self.computed[rid] = start
        self.compute(rid, end)
        if register:
            bm.cache_full_blocks(rid, tokens[:end], end)
        self.release(rid)

    def release(self, rid: str) -> None:
        """What the scheduler does after a step: blocks out of reach go back."""
        bm = self.bm
        before = bm.owners()[rid]
        free = bm.num_free_blocks
        freed = bm.release_behind(rid, self.computed[rid])
        after = bm.owners()[rid]
        assert before[len(before) - len(after):] == after, "only leading blocks go back"
        gone = before[:len(before) - len(after)]
        assert freed == sum(bm.ref_count(b) == 0 for b in gone)
        assert bm.num_free_blocks == free + freed
        bs = bm.block_size
        # What goes is wholly out of reach; with caching, only registered blocks go.
        first_kept = bm.block_table(rid).index(after[0]) if after else None
        if not bm.reach:
            assert not gone
        elif gone:
            assert first_kept * bs <= self.computed[rid] - bm.reach
        assert after, "a request keeps the block of its next token"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=tail_tokens, n=st.integers(1, 9), register=st.booleans())
    def grow(self, data, more, n, register):
        """Compute further (prompt chunks or decoded tokens appended on the way)."""
        bm = self.bm
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid]
        tokens += more
        end = min(len(tokens), self.computed[rid] + n)
        free = bm.num_free_blocks
        need = bm.num_new_blocks(rid, end)
        assert bm.can_allocate(rid, end) == (need <= free)
        if need > free:
            with pytest.raises(RuntimeError):
                bm.allocate(rid, end)
            return
        bm.allocate(rid, end)
        assert bm.num_free_blocks == free - need
        self.compute(rid, end)
        if register:
            # The scheduler passes exactly the computed tokens; more is allowed.
            bm.cache_full_blocks(rid, tokens[:end + data.draw(st.integers(0, 2))], end)
        self.release(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def register(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        end = self.computed[rid]
        self.bm.cache_full_blocks(rid, self.tokens[rid][:end], end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens) + ["nobody"]))
        held = self.bm.owners().get(rid, [])
        freed = sum(self.bm.ref_count(b) == 1 for b in held)
        free = self.bm.num_free_blocks
        self.bm.free(rid)
        assert self.bm.num_free_blocks == free + freed
        self.tokens.pop(rid, None)
        self.computed.pop(rid, None)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=tail_tokens)
    def lookup(self, prefix, tail):
        tokens = PREFIXES[prefix] + tail
        hits = self.bm.find_cached_prefix(tokens)
        self.check_hits(tokens, hits)
        self.hits += bool(hits)

    @invariant()
    def refs_match_tables(self):
        if self.bm is not None:
            check_refs(self.bm)
            assert set(self.bm.owners()) == set(self.tokens)

    @invariant()
    def own_kv_intact(self):
        if self.bm is None:
            return
        bs = self.bm.block_size
        for rid, tokens in self.tokens.items():
            table = self.bm.block_table(rid)
            end = self.computed[rid]
            assert len(table) == self.bm.num_blocks_for(end)
            # Every position a next query reads (all of them, without a reach).
            for pos in range(max(0, end - self.bm.reach) if self.bm.reach else 0, end):
                assert self.kv.get((table[pos // bs], pos % bs)) == tuple(tokens[:pos + 1]), \
                    f"{rid}'s KV at position {pos} was overwritten"

    def teardown(self):
        if self.bm is None:
            return
        event(f"prefix cache hits: {min(self.hits, 3)}{'+' if self.hits >= 3 else ''}")
        for rid in CACHE_IDS:
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.owners() == {}
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))
        # Freeing keeps the cache: every lookup still returns the right content.
        for p in PREFIXES:
            for t in ([], [0], [1, 2], [2, 2, 2, 2, 0]):
                self.check_hits(p + t, self.bm.find_cached_prefix(p + t))


PrefixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                                deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


# ---- recurrent-state slots (linear-attention layers) --------------------------------------

def test_state_slots_go_with_the_first_blocks_and_come_back_with_the_last():
    bm = BlockManager(8, 4, num_state_slots=2)
    assert bm.state_slot("a") == -1 and bm.num_free_slots == 2
    bm.allocate("a", 5)
    bm.allocate("b", 1)
    slots = {bm.state_slot("a"), bm.state_slot("b")}
    assert slots == {0, 1} and bm.num_free_slots == 0
    bm.allocate("a", 9)  # growing keeps the slot
    assert bm.state_slot("a") in slots and bm.num_free_slots == 0
    # Blocks are free but no slot is: a third request cannot start, and nothing changes.
    assert bm.num_free_blocks == 4 and not bm.can_allocate("c", 1)
    with pytest.raises(RuntimeError):
        bm.allocate("c", 1)
    assert bm.block_table("c") == [] and bm.state_slot("c") == -1
    freed = bm.state_slot("a")
    bm.free("a")
    assert bm.state_slot("a") == -1 and bm.num_free_slots == 1
    assert bm.can_allocate("c", 1)
    bm.allocate("c", 1)
    assert bm.state_slot("c") == freed


def test_state_slots_refuse_prefix_caching_without_snapshots():
    with pytest.raises(ValueError, match="prefix caching cannot restore a recurrent state"):
        BlockManager(8, 4, enable_caching=True, num_state_slots=2)
    assert BlockManager(8, 4, num_state_slots=2, num_state_snapshots=2).num_state_snapshots == 0


def test_a_prefix_is_found_up_to_its_last_snapshot_and_restored_from_it():
    bm = BlockManager(16, 4, enable_caching=True, num_state_slots=2, num_state_snapshots=2)
    tokens = list(range(13))
    bm.allocate("a", 13)
    assert bm.reserve_snapshot("a", 10) is None   # not a block boundary
    assert bm.reserve_snapshot("a", 12) == 0      # the step fills snapshot 0 at 12 tokens
    assert bm.reserve_snapshot("a", 12) is None   # one pending already
    assert bm.num_snapshots == 0
    bm.cache_full_blocks("a", tokens, 8)          # the step has not reached it
    assert bm.find_cached_prefix(tokens + [99]) == []  # cached blocks, no state there
    bm.cache_full_blocks("a", tokens, 12)         # now it joins block 2
    table = bm.block_table("a")
    assert bm.num_snapshots == 1
    assert bm.reserve_snapshot("a", 12) is None   # that block has one
    assert bm.find_cached_prefix(tokens + [99]) == table[:3]
    assert bm.find_cached_prefix(tokens[:11] + [99, 99]) == []  # parts in block 3
    bm.free("a")
    hits = bm.find_cached_prefix(tokens + [7])
    bm.allocate("b", 14, hits)
    assert bm.take_restores() == [(0, bm.state_slot("b"))] and bm.take_restores() == []
    assert bm.block_table("b")[:3] == table[:3] and bm.num_snapshots == 1
    # A request freed with its snapshot still pending gives it back.
    assert bm.reserve_snapshot("b", 16) == 1
    bm.free("b")
    assert bm.reserve_snapshot("c", 4) is None    # c holds no slot
    bm.allocate("c", 4)
    assert bm.reserve_snapshot("c", 4) == 1
    # A KV import cannot carry a recurrent state: refused.
    assert bm.begin_import("x", list(range(8))) is None


def test_snapshots_are_kept_least_recently_used_first_and_go_with_their_blocks():
    bm = BlockManager(8, 2, enable_caching=True, num_state_slots=3, num_state_snapshots=2)
    prompts = {r: [i] * 4 for i, r in enumerate("abc")}

    def prefill(r):
        bm.allocate(r, 4)
        sid = bm.reserve_snapshot(r, 4)
        bm.cache_full_blocks(r, prompts[r], 4)
        return sid

    assert prefill("a") == 0 and prefill("b") == 1
    bm.free("a")  # a's prefix used again: b's is the least recently used when c's comes
    bm.allocate("a2", 5, bm.find_cached_prefix(prompts["a"] + [0]))
    assert bm.take_restores()[0][0] == 0
    assert prefill("c") == 1 and bm.num_snapshots == 2
    assert bm.find_cached_prefix(prompts["b"] + [5]) == []  # evicted for c's
    assert len(bm.find_cached_prefix(prompts["c"] + [5])) == 2
    assert len(bm.find_cached_prefix(prompts["a"] + [5])) == 2
    # Evicting a block frees its snapshot with it.
    for r in ("a2", "b", "c"):
        bm.free(r)
    bm.allocate("big", 16)  # every block: the cached ones evicted
    assert bm.num_snapshots == 0 and bm.find_cached_prefix(prompts["c"] + [5]) == []


def test_a_generating_request_keeps_one_trailing_snapshot_at_its_latest_boundary():
    bm = BlockManager(16, 4, enable_caching=True, num_state_slots=3, num_state_snapshots=2)
    toks = list(range(40))
    bm.allocate("a", 8)
    assert bm.reserve_snapshot("a", 8) == 0       # the prompt's
    bm.cache_full_blocks("a", toks, 8)
    bm.allocate("a", 12)                          # decodes: a boundary at 12
    assert bm.reserve_snapshot("a", 12, trailing=True) == 1
    bm.cache_full_blocks("a", toks, 12)
    assert len(bm.find_cached_prefix(toks[:12] + [99])) == 3
    bm.allocate("a", 16)                          # the next boundary: the same one moves on
    assert bm.reserve_snapshot("a", 16, trailing=True) == 1
    bm.cache_full_blocks("a", toks, 16)
    assert len(bm.find_cached_prefix(toks[:12] + [99])) == 2  # block 2's went with it
    assert len(bm.find_cached_prefix(toks[:16] + [99])) == 4
    assert bm.num_snapshots == 2
    # None free: a trailing one takes none (it never evicts a prompt's or another's).
    bm.allocate("b", 4)
    assert bm.reserve_snapshot("b", 4, trailing=True) is None
    assert len(bm.find_cached_prefix(toks[:8] + [99])) == 2
    # Finished, a's last one stays in the cache; a prompt's reservation may evict the least
    # recently used (a's prompt's), then a's last one.
    bm.free("a")
    assert len(bm.find_cached_prefix(toks[:16] + [99])) == 4
    bm.allocate("c", 4)
    assert bm.reserve_snapshot("c", 4) == 0
    assert len(bm.find_cached_prefix(toks[:16] + [99])) == 4


SNAP_IDS = ["r0", "r1", "r2"]
snap_op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(SNAP_IDS), st.integers(0, 3),
              st.integers(1, 6), st.booleans()),
    st.tuples(st.just("grow"), st.sampled_from(SNAP_IDS), st.integers(0, 1),
              st.integers(1, 3), st.booleans()),
    st.tuples(st.just("free"), st.sampled_from(SNAP_IDS), st.just(0), st.just(0),
              st.just(False)),
)


@settings(max_examples=300, deadline=None)
@given(num_snaps=st.integers(1, 3), ops=st.lists(snap_op, max_size=40))
def test_random_snapshots_leak_none_and_restore_only_what_was_saved(num_snaps, ops):
    """Requests over a few prompts that share blocks admit on the cache, grow (a step that
    may keep its state at the last block boundary it reaches, in a new snapshot or the
    request's trailing one), register and free, with a fake state store: a restore copies
    the snapshot filled at the very prefix admitted on; every snapshot is free, pending for
    one request, or held by one cached block."""
    bm = BlockManager(12, 2, enable_caching=True, num_state_slots=3,
                      num_state_snapshots=num_snaps)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    slot_state: dict[int, tuple] = {}   # slot -> the prefix its state sums
    snap_state: dict[int, tuple] = {}   # snapshot -> the prefix it was saved at

    def step(rid, slot, toks, start, end, snap, trailing=False):
        """The forward from start to end: with `snap`, the state kept at the last block
        boundary it reaches (the scheduler's choice; trailing: a decode step's), where the
        block manager reserves one."""
        point = end // 2 * 2
        moves = trailing and rid in bm._trailing
        sid = (bm.reserve_snapshot(rid, point, trailing=trailing) if snap and start < point
               else None)
        if moves and sid is not None:
            event("a trailing snapshot moved on")
        if sid is not None:
            snap_state[sid] = tuple(toks[:point])
        slot_state[slot] = tuple(toks[:end])

    def run_copies():
        for sid, slot in bm.take_restores():
            slot_state[slot] = snap_state[sid]

    for kind, rid, which, n, snap in ops:
        if kind == "admit" and rid not in tokens:
            toks = [which % 2] * 4 + [which] * 8  # prompts 0 / 2 and 1 / 3 share 2 blocks
            hits = bm.find_cached_prefix(toks)
            end = min(len(toks), len(hits) * 2 + n)
            if not bm.can_allocate(rid, end, hits):
                continue
            bm.allocate(rid, end, hits)
            run_copies()
            slot = bm.state_slot(rid)
            start = len(hits) * 2
            if hits:
                assert slot_state[slot] == tuple(toks[:start]), "restored the wrong state"
                event(f"restored with {min(bm.num_snapshots, 2)}+ snapshots held")
            step(rid, slot, toks, start, end, snap)
            tokens[rid], computed[rid] = toks, end
        elif kind == "grow" and rid in tokens:
            end = min(len(tokens[rid]), computed[rid] + n)
            if not bm.can_allocate(rid, end):
                continue
            bm.allocate(rid, end)
            step(rid, bm.state_slot(rid), tokens[rid], computed[rid], end, snap, bool(which))
            computed[rid] = end
        elif kind == "free":
            bm.free(rid)
            tokens.pop(rid, None)
            computed.pop(rid, None)
            continue
        else:
            continue
        bm.cache_full_blocks(rid, tokens[rid], computed[rid])
        held = dict(bm._snap)
        assert len(set(held.values())) == len(held) == bm.num_snapshots <= num_snaps
        assert bm.num_snapshots + len(bm._free_snaps) + len(bm._pending) == num_snaps
        assert all(b in bm._block_key for b in held)
        # A trailing snapshot: one a request at most, held by a block, its owner running.
        assert {v: k for k, v in bm._trailing.items()} == bm._trailing_of
        assert all(sid in bm._snap_block and r in tokens for r, sid in bm._trailing.items())
        check_refs(bm)
    for rid in SNAP_IDS:
        bm.free(rid)
    assert bm.num_free_slots == 3 and bm.owners() == {}


@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(1, 4), ops=st.lists(op, max_size=60))
def test_random_tables_hold_one_slot_each_and_leak_none(num_slots, ops):
    """Random growth and frees with fewer slots than requests: every table holds exactly
    one slot, no two tables share one, a request starts only with a slot free, and every
    slot is free again at the end."""
    bm = BlockManager(24, 2, num_state_slots=num_slots)
    for kind, rid, extra in ops:
        if kind == "grow":
            target = len(bm.block_table(rid)) * 2 + extra
            new_to_pool = rid not in bm.owners()
            ok = bm.can_allocate(rid, target)
            if new_to_pool and bm.num_free_slots == 0:
                assert not ok
            if ok:
                bm.allocate(rid, target)
        else:
            bm.free(rid)
        held = [bm.state_slot(r) for r in bm.owners()]
        assert -1 not in held and len(held) == len(set(held))
        assert bm.num_free_slots + len(held) == num_slots
        owned = [b for table in bm.owners().values() for b in table]
        assert len(owned) == len(set(owned)) and bm.num_free_blocks + len(owned) == 24
    for rid in REQUEST_IDS:
        bm.free(rid)
    assert bm.num_free_slots == num_slots and bm.owners() == {}


# ---- block groups (a hybrid model: full-attention and windowed layers) -------------------

def test_block_groups_fill_from_one_pool_and_the_windowed_ones_give_back():
    bm = BlockManager(12, 2, groups=(3,))
    new = bm.allocate("a", 8)  # 4 blocks in each group
    assert len(new) == 4 and len(bm.group_tables("a")[0]) == 4
    assert bm.num_free_blocks == 4 and bm.num_held("a") == 8
    # Position 7 reads no key before 7 - 3 in the windowed group: its blocks 0 and 1 go
    # back, and keep their places in its table.
    assert bm.release_behind("a", 7) == 2
    assert bm.num_held("a") == 6 and len(bm.group_tables("a")[0]) == 4
    assert bm.owners()["a"] == bm.block_table("a") + bm.group_tables("a")[0][2:]
    # Growing to 10 tokens takes a block in each group.
    assert bm.num_new_blocks("a", 10) == 2
    # Far ahead, the windowed group holds its reach and a step's tokens at most.
    assert bm.num_to_grow("a", 40, step_tokens=1) == (20 - 4) + (3 - 2)
    bm.free("a")
    assert bm.num_free_blocks == 12
    with pytest.raises(ValueError, match="groups"):
        BlockManager(4, 2, reach=2, groups=(3,))


def test_a_hybrid_prefix_hit_needs_only_the_windowed_pages_in_reach():
    bm = BlockManager(16, 2, enable_caching=True, groups=(2,))
    tokens = list(range(9))
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", tokens, 8)
    bm.release_behind("a", 8)  # the windowed group's blocks 0..2 go back, still cached
    bm.free("a")
    hit = bm.find_cached_prefix(tokens)
    assert len(hit) == 4 and len(hit.groups[0]) == 4
    # The free queue: 8 uncached pages, then the windowed pages 0..3, then the full
    # group's blocks. Evict the windowed group's pages 0 and 1: the hit does not need them
    # (out of reach of its end).
    bm.allocate("x", 10)  # 5 pages in each group
    assert len(bm.find_cached_prefix(tokens)) == 4
    bm.free("x")
    # Evict its pages 2 and 3 too, in reach of every hit's end: no hit is left.
    bm.allocate("y", 12)
    assert bm.find_cached_prefix(tokens) == []
    bm.free("y")
    assert bm.num_free_blocks == 16


class GroupedCacheMachine(PrefixCacheMachine):
    """PrefixCacheMachine's requests against a pool of block groups: every group's table
    written by the fake forward pass, only the pages in each group's reach read (its
    grow, free, lookup, register rules, invariants and teardown as they are)."""

    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 3]),
                groups=st.sampled_from([(1,), (3,), (0,), (2, 2), (0, 3), (5, 0, 2)]))
    def make_pool(self, num_blocks, block_size, groups):
        self.bm = BlockManager(num_blocks, block_size, enable_caching=True, groups=groups)

    def reaches(self) -> tuple[int, ...]:
        return (0, *self.bm.groups)

    def tables(self, rid: str) -> list[list[int]]:
        return [self.bm.block_table(rid), *self.bm.group_tables(rid)]

    def in_reach(self, reach: int, end: int) -> range:
        """The positions a next query at `end` reads in a group of this reach."""
        return range(max(0, end - reach) if reach else 0, end)

    def check_hits(self, tokens: list[int], hits) -> None:
        bs = self.bm.block_size
        assert len(hits) * bs <= max(0, len(tokens) - 1), "no token left to compute"
        pages = [list(hits), *getattr(hits, "groups", [[] for _ in self.bm.groups])]
        end = len(hits) * bs
        for reach, table in zip(self.reaches(), pages):
            assert len(table) == len(hits)
            # (A page out of reach may be anything: masked.)
            start = self.in_reach(reach, end).start // bs * bs
            for pos in range(start, end):
                assert self.kv.get((table[pos // bs], pos % bs)) == tuple(tokens[:pos + 1]), \
                    f"cached page {table[pos // bs]} does not hold the prefix to {pos}"

    def compute(self, rid: str, end: int) -> None:
        bs = self.bm.block_size
        held = set(self.bm.owners()[rid])
        for table in self.tables(rid):
            for pos in range(self.computed[rid], end):
                b = table[pos // bs]
                assert self.bm.ref_count(b) == 1, f"writing into shared page {b}"
                assert b in held, f"writing into page {b}, given back"
                self.kv[(b, pos % bs)] = tuple(self.tokens[rid][:pos + 1])
        self.computed[rid] = end

    @precondition(lambda self: len(self.tokens) < len(CACHE_IDS))
    @rule(data=st.data(), prefix=st.sampled_from(range(len(PREFIXES))),
          tail=tail_tokens, frac=st.floats(0, 1), register=st.booleans())
    def admit(self, data, prefix, tail, frac, register):
        bm = self.bm
        rid = data.draw(st.sampled_from([r for r in CACHE_IDS if r not in self.tokens]))
        tokens = PREFIXES[prefix] + tail
        if not tokens:
            return
        hits = bm.find_cached_prefix(tokens)
        self.check_hits(tokens, hits)
        self.hits += bool(hits)
        bs = bm.block_size
        start = len(hits) * bs
        end = start + 1 + int(frac * (len(tokens) - start - 1))
        pages = [list(hits), *getattr(hits, "groups", [[] for _ in bm.groups])]
        held = {p for reach, t in zip(self.reaches(), pages)
                for p in t[self.in_reach(reach, start).start // bs:]}
        taken = sum(bm.ref_count(p) == 0 for p in held)
        new = (bm.num_blocks_for(end) - len(hits)) * len(pages)
        free = bm.num_free_blocks
        fits = new + taken <= free
        assert bm.can_allocate(rid, end, hits) == fits
        if not fits:
            with pytest.raises(RuntimeError):
                bm.allocate(rid, end, hits)
            assert bm.owners().get(rid, []) == [] and bm.num_free_blocks == free
            return
        bm.allocate(rid, end, hits)
        for t, hit in zip(self.tables(rid), pages):
            assert t[:len(hit)] == hit and len(t) == bm.num_blocks_for(end)
        assert bm.num_free_blocks == free - new - taken
        self.tokens[rid] = tokens
        self.computed[rid] = start
        self.compute(rid, end)
        if register:
            bm.cache_full_blocks(rid, tokens[:end], end)
        self.release(rid)

    def release(self, rid: str) -> None:
        bm = self.bm
        free = bm.num_free_blocks
        before = [t[:] for t in self.tables(rid)]
        held = set(bm.owners()[rid])
        freed = bm.release_behind(rid, self.computed[rid])
        now = set(bm.owners()[rid])
        assert now <= held and bm.num_free_blocks == free + freed
        assert freed == sum(bm.ref_count(p) == 0 for p in held - now)
        bs = bm.block_size
        for reach, table in zip(self.reaches(), before):
            gone = [i for i, p in enumerate(table) if p in held - now]
            if not reach:
                assert not gone
            for i in gone:  # wholly out of reach of the next token
                assert (i + 1) * bs <= self.computed[rid] - reach
            assert table[-1] in now, "a request keeps the page of its next token"

    @invariant()
    def own_kv_intact(self):
        if self.bm is None:
            return
        bs = self.bm.block_size
        for rid, tokens in self.tokens.items():
            end = self.computed[rid]
            for reach, table in zip(self.reaches(), self.tables(rid)):
                assert len(table) == self.bm.num_blocks_for(end)
                for pos in self.in_reach(reach, end):
                    assert self.kv.get((table[pos // bs], pos % bs)) == \
                        tuple(tokens[:pos + 1]), f"{rid}'s KV at {pos} was overwritten"


GroupedCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30,
                                                 deadline=None)
TestGroupedCacheMachine = GroupedCacheMachine.TestCase
