"""The block manager's side of the lower KV tiers (kv_tiers.py): loading blocks and limbo.

A prefix hit in RAM or on disk takes fresh device blocks, names them at once (so a second request
with the same prefix shares them rather than restoring twice) and queues their restore under one
ticket. Until the KV mover reports the ticket done (finish_restores) those blocks are *loading*:
a request holding one is not scheduled. A loading block whose last reference goes away is kept
in *limbo* (named, neither free nor parked, since the copy still writes into it) and parked when
its restore finishes; a hit on it meanwhile revives it from limbo.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from hetero.engine.prefix_cache import block_hash

if TYPE_CHECKING:
    from hetero.engine.prefix_cache import PrefixCache
    from hetero.engine.request import Request
    from hetero.kv_tiers.policy import KVTiers


class TieredBlocks:
    """Mixed into BlockManager: restores in flight, and moving parked blocks down a tier."""

    _cache: PrefixCache
    _free: deque[int]
    _match: Callable[[Request], list[tuple[bytes, int | None]]]

    def _init_tiers(self, tiers: KVTiers | None) -> None:
        self.tiers = tiers
        self._loading: dict[int, int] = {}  # block -> restore ticket filling it
        self._ticket_blocks: dict[int, list[int]] = {}
        self._limbo: set[int] = set()

    def _claim(self, hits: list[tuple[bytes, int | None]]):
        """Make the lower-tier hits safe to restore; cut the run at the first that is not."""
        assert self.tiers is not None
        names = [h for h, b in hits if b is None]
        claimed = self.tiers.claim(names)
        if len(claimed) < len(names):
            cut = [i for i, (_, b) in enumerate(hits) if b is None][len(claimed)]
            hits = hits[:cut]
        return hits, claimed

    def _restore(self, hits, table: list[int], claimed) -> None:
        """Name the fresh blocks of lower-tier hits and queue their restore; they are loading."""
        assert self.tiers is not None
        blocks = [t for (h, b), t in zip(hits, table) if b is None]
        for (h, b), t in zip(hits, table):
            if b is None:
                self._cache.register(t, h)
        ticket = self.tiers.restore(claimed, blocks)
        self._ticket_blocks[ticket] = blocks
        for b in blocks:
            self._loading[b] = ticket

    def _want_gaps(self, req: Request) -> None:
        """After an admission: prompt blocks past the hit that the disk tier lacks while it holds
        a later block of the same chain (a file lost between runs) are written to disk once
        computed (KVTiers.committed), so the whole chain is a hit again next time."""
        disk = None if self.tiers is None else self.tiers.disk
        if disk is None or not len(disk):
            return
        bs, names = self.block_size, self._hashes[req.request_id]
        prev, chain = (names[-1] if names else None), []
        for i in range(len(names), (req.num_tokens - 1) // bs):
            prev = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            chain.append(prev)
        last = max((k for k, h in enumerate(chain) if disk.contains(h)), default=0)
        missing = [h for h in chain[:last] if not disk.contains(h)]
        if missing:
            disk.want(missing)

    def _committed(self, block: int, name: bytes) -> None:
        if self.tiers is not None:
            self.tiers.committed(block, name)

    def fetching(self, req: Request) -> bool:
        """True while disk blocks of req's prefix hit are being read ahead: admit it later."""
        prefetch = None if self.tiers is None else self.tiers.prefetch
        if prefetch is None or not len(prefetch.disk):
            return False
        tiers = self.tiers
        names = [h for h, b in self._match(req) if b is None and tiers.where(h) == "disk"]
        return bool(names) and prefetch.pending(names)

    def is_loading(self, req: Request) -> bool:
        """True while a restore is still filling one of req's blocks (do not schedule it)."""
        return bool(self._loading) and any(b in self._loading for b in req.block_table)

    @property
    def num_loading_blocks(self) -> int:
        return len(self._loading)

    def finish_restores(self, tickets: list[int]) -> None:
        """The mover finished these restores: their blocks hold valid KV now."""
        for t in tickets:
            for b in self._ticket_blocks.pop(t):
                del self._loading[b]
                if b in self._limbo:
                    self._limbo.remove(b)
                    self._cache.park(b)
            if self.tiers is not None:
                self.tiers.restored(t)

    def named_blocks(self) -> list[tuple[bytes, int]]:
        """(name, block) of every named block whose KV is in place (for saving to disk)."""
        return [(h, b) for h, b in self._cache.named_items() if b not in self._loading]

    def evict_parked(self) -> int:
        """Evict every parked block now (to the lower tiers when there are some); how many."""
        n = 0
        while self._cache.num_parked:
            block, name = self._cache.evict_named()
            if self.tiers is not None:
                self.tiers.evicted(block, name)
            self._free.append(block)
            n += 1
        return n
