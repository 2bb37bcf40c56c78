"""Allocation of fixed-size KV-cache blocks to sequences (plain bookkeeping, no tensors), and the
prefix cache: full blocks whose keys and values are computed stay findable by their contents
(the tokens of the block and of every block before it), so a later prompt that begins with the
same tokens reuses them instead of computing them again.

A block is shared by every sequence that reached it through the cache (a reference count); it is
never written after it is full, since a sequence only writes at its own positions past the tokens
it has cached. A block nobody holds goes to the free pool, oldest first out; one that was
registered keeps its contents there, findable, until it is handed out again.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b

from specfork.engine.sequence import Sequence


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a 128-bit digest of the previous block's key and this block's
    tokens, so equal keys mean equal prefixes (a collision is as unlikely as 2^-64 over 2^32
    blocks)."""
    return blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # registered blocks (held or free) -> their key
        self._block_of: dict[bytes, int] = {}
        self.prefix_hit_tokens = 0  # prompt tokens taken from the cache instead of computed, in all

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
            seq.block_table.append(self._take_free())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of ``seq`` beyond the first ``num_tokens`` tokens."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._drop(seq.block_table.pop())
        if self.prefix_caching:
            del seq.block_keys[keep:]

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks owned by the caller (e.g. a draft tree branch); give them back with
        ``release_blocks``."""
        if count > len(self._free):
            raise RuntimeError("KV cache exhausted")
        return [self._take_free() for _ in range(count)]

    def release_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            self._drop(block)

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks, its full computed ones registered first (so that a
        preempted sequence, or the next turn of a conversation, finds them). The last blocks go
        to the pool first, so they are the first handed out again."""
        self.register(seq)
        for block in reversed(seq.block_table):
            self._drop(block)
        seq.block_table.clear()
        if self.prefix_caching:
            seq.block_keys.clear()
        seq.num_cached_tokens = 0

    # -- the prefix cache ----------------------------------------------------------------

    def cached_prefix(self, seq: Sequence, limit: int) -> list[tuple[int, bytes]]:
        """The registered blocks (with their keys) that hold ``seq``'s first tokens, up to ``limit``
        tokens; nothing is taken yet (``take_prefix`` does, once the sequence is admitted)."""
        if not self.prefix_caching or seq.block_table:
            return []
        size, parent, found = self.block_size, b"", []
        for start in range(0, limit - size + 1, size):
            key = block_key(parent, seq.token_ids[start : start + size])
            block = self._block_of.get(key)
            if block is None:
                break
            found.append((block, key))
            parent = key
        return found

    def idle_among(self, found: list[tuple[int, bytes]]) -> int:
        """How many of ``found`` sit in the free pool (taking them leaves that many fewer free)."""
        return sum(self._refs[block] == 0 for block, _ in found)

    def take_prefix(self, seq: Sequence, found: list[tuple[int, bytes]]) -> None:
        """Give ``seq`` (holding no blocks) the blocks ``cached_prefix`` found, counted as cached."""
        for block, key in found:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            seq.block_table.append(block)
            seq.block_keys.append(key)
        seq.num_cached_tokens = len(found) * self.block_size
        self.prefix_hit_tokens += seq.num_cached_tokens

    def register(self, seq: Sequence) -> None:
        """Make ``seq``'s full blocks whose keys and values are computed findable by later prompts
        (a block whose key another block already has stays unregistered)."""
        if not self.prefix_caching:
            return
        size = self.block_size
        full = min(seq.num_cached_tokens, len(seq)) // size
        for j in range(len(seq.block_keys), min(full, len(seq.block_table))):
            parent = seq.block_keys[j - 1] if j else b""
            key = block_key(parent, seq.token_ids[j * size : (j + 1) * size])
            seq.block_keys.append(key)
            block = seq.block_table[j]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:  # its contents are about to be overwritten
            del self._block_of[key]
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None
