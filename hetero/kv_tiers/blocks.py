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

from hetero.engine.kv_groups import group_name
from hetero.engine.prefix_cache import block_hash
from hetero.engine.prefix_match import PrefixHit, match_prefix

if TYPE_CHECKING:
    from hetero.engine.prefix_cache import PrefixCache
    from hetero.engine.request import Request
    from hetero.kv_tiers.policy import KVTiers


class TieredBlocks:
    """Mixed into BlockManager: restores in flight, and moving parked blocks down a tier."""

    _cache: PrefixCache
    _free: deque[int]
    _match: Callable[[Request], PrefixHit]
    _cost: Callable[[PrefixHit, int], int]
    windows: tuple[int, ...]

    def _init_tiers(self, tiers: KVTiers | None) -> None:
        self.tiers = tiers
        self._loading: dict[int, int] = {}  # block -> restore ticket filling it
        self._ticket_blocks: dict[int, list[int]] = {}
        self._limbo: set[int] = set()

    def _claim(self, hit: PrefixHit, n: int) -> tuple[PrefixHit | None, list]:
        """Make the lower-tier blocks of `hit` safe to restore. Where one cannot be claimed (a
        file gone bad), the hit is matched again without it (a shorter one, whose window blocks
        may be others) and those are claimed, until every block it needs is; claims it does not
        take are given back. None when that hit needs more free blocks than there are (for n
        new tokens)."""
        tiers = self.tiers
        assert tiers is not None
        got: dict[bytes, tuple] = {}
        bad: set[bytes] = set()
        cache = self._cache

        def locate(name: bytes) -> int | str | None:
            block = cache.lookup(name)
            if block is not None or name in bad:
                return block
            return "claimed" if name in got else tiers.where(name)

        while True:
            need = [b for b in hit.lower if b.name not in got]
            claimed = tiers.claim([b.name for b in need])
            got.update(zip((b.name for b in need), claimed))
            if len(claimed) == len(need):
                break
            bad.add(need[len(claimed)].name)
            hit = match_prefix(hit.chain, self.windows, self.block_size, locate)
        taken = [got.pop(b.name) for b in hit.lower]
        tiers.unclaim(list(got.values()))
        if self._cost(hit, n) > self.num_free_blocks:  # type: ignore[attr-defined]
            tiers.unclaim(taken)
            return None, []
        return hit, taken

    def _restore(self, fills: list[tuple[bytes, int]], claimed) -> None:
        """Name the fresh blocks (name, block) of lower-tier hits and queue their restore under
        one ticket; they are loading until it finishes."""
        assert self.tiers is not None
        blocks = [b for _, b in fills]
        for name, b in fills:
            self._cache.register(b, name)
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
        bs, names, w = self.block_size, self._hashes[req.request_id], self.windows[0]
        prev, chain = (names[-1] if names else None), []
        for i in range(len(names), (req.num_tokens - 1) // bs):
            prev = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            chain.append(group_name(w, prev))  # the first group's blocks: full attention's
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
        names = [b.name for b in self._match(req).blocks if b.where == "disk"]
        return bool(names) and prefetch.pending(names)

    def is_loading(self, req: Request) -> bool:
        """True while a restore is still filling one of req's blocks (do not schedule it)."""
        loading = self._loading
        return bool(loading) and any(b in loading for t in req.block_tables for b in t)

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
