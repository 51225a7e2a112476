"""The block manager's invariants, checked by tests after every call (BlockManager.check)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetero.engine.kv_groups import first_needed, group_name

if TYPE_CHECKING:
    from hetero.engine.block_manager import BlockManager


def check_blocks(bm: BlockManager) -> None:
    """Raise AssertionError unless the bookkeeping is consistent."""
    counts = [0] * bm.num_blocks
    for rid, req in bm._live.items():
        _check_tables(bm, rid, req)
        for t in req.block_tables:
            for b in bm._held(t):
                counts[b] += 1
    if counts != bm._ref:
        raise AssertionError("reference counts differ from the block tables")
    free, parked, limbo = set(bm._free), set(bm._cache.parked_blocks()), bm._limbo
    if len(free) != len(bm._free) or free & parked or limbo & (free | parked):
        raise AssertionError("a block is listed twice among free, parked and limbo blocks")
    if any(bm._ref[b] for b in free | parked | limbo):
        raise AssertionError("a referenced block is also free, parked or in limbo")
    used = sum(1 for r in bm._ref if r > 0)
    if used + len(free) + len(parked) + len(limbo) != bm.num_blocks:
        raise AssertionError("free + parked + limbo + used blocks != total")
    if not limbo <= set(bm._loading) or set(bm._loading) & (free | parked):
        raise AssertionError("a loading block is free or parked, or limbo is not loading")
    if bm.tiers is not None:
        bm.tiers.check()
    bm._cache.check()
    if any(bm._cache.hash_of(b) is not None for b in free):
        raise AssertionError("a free block still has a name")
    if any(bm._ref[d] == 0 for _, d in bm._copies):
        raise AssertionError("a queued copy writes into an unreferenced block")


def _check_tables(bm: BlockManager, rid: str, req) -> None:
    """One live request's tables: one a group, all of one length, each block once; a window
    group's null entries a prefix that ends at or before its window; names that fit."""
    tables, bs, null = req.block_tables, bm.block_size, bm.null_block
    if len(tables) != len(bm.windows) or len({len(t) for t in tables}) != 1:
        raise AssertionError(f"{rid}: not one table of one length a group: {tables}")
    held = [b for t in tables for b in bm._held(t)]
    if len(set(held)) != len(held):
        raise AssertionError(f"{rid}: a block appears twice in {tables}")
    if req.num_computed_tokens > len(tables[0]) * bs:
        raise AssertionError(f"{rid}: computed tokens exceed its blocks")
    names = bm._hashes[rid]
    if len(names) > req.num_computed_tokens // bs:
        raise AssertionError(f"{rid}: more block names than full computed blocks")
    for w, t in zip(bm.windows, tables):
        nulls = sum(1 for b in t if b == null)
        if any(b == null for b in t[nulls:]):
            raise AssertionError(f"{rid}: a window table's null entries are not a prefix: {t}")
        if nulls > first_needed(w, req.num_computed_tokens, bs):
            raise AssertionError(f"{rid}: a block the window still reads was released: {t}")
        for b, h in zip(t, names, strict=False):
            if b != null and bm._cache.hash_of(b) not in (None, group_name(w, h)):
                raise AssertionError(f"{rid}: block {b} is named for other tokens")
