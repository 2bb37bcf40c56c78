"""Allocation of fixed-size KV-cache blocks to sequences (plain bookkeeping, no tensors), and the
prefix cache: full blocks whose keys and values are computed stay findable by their contents
(the tokens of the block and of every block before it, and for a cache whose rows also read the
tokens after them, those too), so a later prompt that begins with the same tokens reuses them
instead of computing them again.

A block is shared by every holder that reached it through the cache (a reference count); it is
never written after it is full, since a holder only writes at its own positions past the tokens
it has cached. A block nobody holds goes to the free pool, oldest first out (blocks with nothing
registered in them before any cached one); one that was registered keeps its contents there,
findable, until it is handed out again. Where two blocks hold the same contents, the key points at
one that is held rather than at an idle copy, so that later prompts share it.

Holders are sequences (the target's cache) or a drafter's per-sequence states: anything with a
``block_table``, ``block_keys`` and ``num_cached_tokens``.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a 128-bit digest of the previous block's key and the tokens this
    block's contents depend on, so equal keys mean equal prefixes (a collision is as unlikely as
    2^-64 over 2^32 blocks)."""
    return blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False, lookahead: int = 0) -> None:
        """``lookahead``: how many tokens past a block its contents depend on (1 for an EAGLE-3
        head, whose row t reads the token at t + 1)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.lookahead = lookahead
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

    def can_grow(self, seq, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens in total."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens in total."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self._free):
            raise RuntimeError("KV cache exhausted: the scheduler must check can_grow first")
        for _ in range(missing):
            seq.block_table.append(self._take_free())

    def shrink(self, seq, num_tokens: int) -> None:
        """Release the blocks of ``seq`` beyond the first ``num_tokens`` tokens."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._drop(seq.block_table.pop())
        if self.prefix_caching and len(seq.block_keys) > num_tokens // self.block_size:
            # a block cut into is written again from num_tokens on: no longer what its key says
            del seq.block_keys[num_tokens // self.block_size :]
            cut = seq.block_table[-1]
            assert self._refs[cut] == 1, "a shared block cannot be cut into"
            key = self._key_of.pop(cut, None)
            if key is not None:
                del self._block_of[key]

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks owned by the caller (e.g. a draft tree branch); give them back with
        ``release_blocks``."""
        if count > len(self._free):
            raise RuntimeError("KV cache exhausted")
        return [self._take_free() for _ in range(count)]

    def release_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            self._drop(block)

    def free(self, seq) -> None:
        """Release all of ``seq``'s blocks (``register`` them first to keep them findable). The
        last blocks go to the pool first, so they are the first handed out again."""
        for block in reversed(seq.block_table):
            self._drop(block)
        seq.block_table.clear()
        if self.prefix_caching:
            seq.block_keys.clear()
        seq.num_cached_tokens = 0

    # -- the prefix cache ----------------------------------------------------------------

    def cached_prefix(self, tokens: list[int], limit: int) -> list[tuple[int, bytes]]:
        """The registered blocks (with their keys) that hold the first of ``tokens``, up to
        ``limit`` of them; nothing is taken yet (``take_prefix`` does, once the holder is admitted)."""
        if not self.prefix_caching:
            return []
        found = []
        for key in self._chained_keys(tokens, [], limit):
            block = self._block_of.get(key)
            if block is None:
                break
            found.append((block, key))
        return found

    def idle_among(self, found: list[tuple[int, bytes]]) -> int:
        """How many of ``found`` sit in the free pool (taking them leaves that many fewer free)."""
        return sum(self._refs[block] == 0 for block, _ in found)

    def take_prefix(self, holder, found: list[tuple[int, bytes]]) -> None:
        """Give ``holder`` (holding no blocks) the blocks ``cached_prefix`` found, counted as cached."""
        assert not holder.block_table, "a holder takes cached blocks before any of its own"
        for block, key in found:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            holder.block_table.append(block)
            holder.block_keys.append(key)
        holder.num_cached_tokens = len(found) * self.block_size
        self.prefix_hit_tokens += holder.num_cached_tokens

    def keys_after(self, tokens: list[int], known: list[bytes], end: int) -> list[bytes]:
        """The keys of the full blocks within the first ``end`` positions of ``tokens`` that follow
        the ``known`` leading ones (chained on from them)."""
        return list(self._chained_keys(tokens, known, end))

    def _chained_keys(self, tokens: list[int], known: list[bytes], end: int):
        """``keys_after``'s keys one at a time (a caller may stop at the first it cannot use)."""
        size, parent = self.block_size, known[-1] if known else b""
        for j in range(len(known), min(end, len(tokens) - self.lookahead) // size):
            parent = block_key(parent, tokens[j * size : (j + 1) * size + self.lookahead])
            yield parent

    def register(self, holder, tokens: list[int], computed: int) -> None:
        """Make ``holder``'s full blocks within its first ``computed`` positions (of ``tokens``,
        the tokens it holds) findable by later prompts (a block whose key another block already
        has stays unregistered)."""
        if not self.prefix_caching:
            return
        keys = holder.block_keys
        for key in self.keys_after(tokens, keys, min(computed, len(holder.block_table) * self.block_size)):
            block = holder.block_table[len(keys)]
            keys.append(key)
            if block in self._key_of:
                continue  # taken from the cache: registered already
            cached = self._block_of.get(key)
            if cached is not None and self._refs[cached] == 0:
                del self._key_of[cached]  # an idle copy gives way to a held one, so later prompts share it
                cached = None
            if cached is None:
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
            if block not in self._key_of:  # nothing to find in it: handed out before cached blocks
                self._free.move_to_end(block, last=False)
