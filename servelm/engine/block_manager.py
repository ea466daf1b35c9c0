"""BlockManager: the paged KV pool's bookkeeping: which blocks each request owns (no torch)."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out fixed-size KV blocks from a free list and takes them back.

    Invariant: every block id is either in the free list or in exactly one request's table.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still needs so that its table holds num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold num_tokens tokens; returns the new block ids."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        self._free.extend(self._tables.pop(request_id, []))

    def owners(self) -> dict[str, list[int]]:
        """A copy of every request's table, for checks and metrics."""
        return {k: list(v) for k, v in self._tables.items()}
