"""Content addresses of full KV blocks, and the LRU of freed blocks that still hold them.

A full block is named by a hash of its token ids chained with the hash of the block before it:

    h0 = H(ROOT,  t[0:B])     h1 = H(h0, t[B:2B])     h2 = H(h1, t[2B:3B]) ...

so two blocks with equal tokens after different prefixes get different names (their KV differs:
attention saw different keys), and a hit on block i implies hits on blocks 0..i-1.

H is SHA-256 rather than Python's `hash((prev, tuple(tokens)))`: the daemon serves many users
from one cache, and a hit hands one user's KV to another. Python's tuple hash is 64 bits, fast
and predictable, so a crafted prompt could collide with (and read or poison) another user's
block; SHA-256 makes collisions, accidental or forged, out of reach. It costs about a
microsecond per block of 16 tokens, once, when the block fills. Token ids are packed as little-
endian int64 so a name means the same on every machine (a disk tier may outlive the process).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_ROOT = b"hetero-kv-prefix-v1"  # the "previous hash" of a sequence's first block


def block_hash(prev: bytes | None, tokens: Sequence[int]) -> bytes:
    """The 32-byte name of a full block of `tokens` that follows the block named `prev`."""
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.sha256(_ROOT if prev is None else prev)
    h.update(packed.tobytes())
    return h.digest()


class PrefixCache:
    """Maps block hashes to block ids; keeps freed named blocks in least-recently-freed order.

    A named block is either *live* (some request references it) or *parked* (reference count
    zero, still holding valid KV, reusable by a hit until the allocator evicts it). Eviction takes
    the least recently parked block first; the block manager parks a request's blocks tail first,
    so the shared prefixes that many requests start with are the last to go.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_named(self) -> int:
        return len(self._block_of)

    def lookup(self, h: bytes) -> int | None:
        return self._block_of.get(h)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def register(self, block: int, h: bytes) -> bool:
        """Name a live block that just filled; False when another block already has the name.

        A duplicate (the same tokens computed twice, e.g. a full-hit prompt recomputing its last
        block) stays unnamed: one name, one block, so a hit is never ambiguous.
        """
        known = self._hash_of.get(block)
        if known is not None:
            if known != h:
                raise RuntimeError(f"block {block} is already named by another token run")
            return True
        if h in self._block_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A named block's last reference went away: keep it, newest at the tail."""
        if block not in self._hash_of:
            raise RuntimeError(f"block {block} has no name and cannot be parked")
        self._parked[block] = None

    def unpark(self, block: int) -> None:
        """A hit revived a parked block."""
        del self._parked[block]

    def evict(self) -> int:
        """Take the least recently parked block for reuse, forgetting its name."""
        return self.evict_named()[0]

    def evict_named(self) -> tuple[int, bytes]:
        """evict(), also returning the name the block had (a lower KV tier keeps it by name)."""
        block, _ = self._parked.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._block_of[h]
        return block, h

    def evict_all(self) -> list[int]:
        """Forget every parked block (for benchmarks that must start cold); returns them."""
        blocks = []
        while self._parked:
            blocks.append(self.evict())
        return blocks

    def parked_blocks(self) -> list[int]:
        """Parked blocks in eviction order (for invariant checks and tests)."""
        return list(self._parked)

    def named_items(self) -> list[tuple[bytes, int]]:
        return list(self._block_of.items())

    def check(self) -> None:
        """The two maps are inverse; every parked block is named."""
        if len(self._block_of) != len(self._hash_of):
            raise AssertionError("hash->block and block->hash maps differ in size")
        for h, b in self._block_of.items():
            if self._hash_of.get(b) != h:
                raise AssertionError(f"block {b}: name maps are not inverse")
        for b in self._parked:
            if b not in self._hash_of:
                raise AssertionError(f"parked block {b} has no name")
