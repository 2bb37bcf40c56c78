"""Allocation of fixed-size KV-cache blocks to sequences (plain bookkeeping, no tensors)."""

from __future__ import annotations

from collections import deque

from specfork.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens in total."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens in total."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self._free):
            raise RuntimeError("KV cache exhausted: the scheduler must check can_grow first")
        for _ in range(missing):
            seq.block_table.append(self._free.popleft())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of ``seq`` beyond the first ``num_tokens`` tokens."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks owned by the caller (e.g. a draft tree branch); give them back with
        ``release_blocks``."""
        if count > len(self._free):
            raise RuntimeError("KV cache exhausted")
        return [self._free.popleft() for _ in range(count)]

    def release_blocks(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_cached_tokens = 0
