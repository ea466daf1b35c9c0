"""BlockManager tests: paged KV block bookkeeping, unit cases plus a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
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
