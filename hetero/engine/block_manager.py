"""Paged KV blocks over integer ids: reference counts, prefix caching, copy-on-write forks.

The KV pool is `num_blocks` blocks of `block_size` token slots; block b holds the flat slots
[b*block_size, (b+1)*block_size). A request's block_table lists its blocks in position order:

    positions  0 ........ B-1 | B ....... 2B-1 | 2B .. 2B+5 . . |
    table      [    17        ,      4         ,      9          ]   (B = block_size)
    slot(p) = table[p // B] * B + p % B

Each block is in exactly one of three states:
    free    refcount 0, no name: first choice for a new block
    parked  refcount 0, named by its tokens (prefix_cache): valid KV that a hit can revive; taken
            (least recently freed first) only when no free block is left
    live    refcount >= 1 (several requests share a block after a prefix hit or a fork)

Blocks are taken per step (for the tokens being scheduled), not for the whole prompt at once:
with chunked prefill an 8k-token prompt computed 512 tokens a step would otherwise hold blocks
it fills only many steps later, blocks that running decodes need now.

With lower KV tiers (kv_tiers.py: host RAM, disk), an evicted parked block keeps its data a tier
down, and a prefix hit there takes fresh blocks that fill asynchronously (block_tiers.py: such
blocks are *loading*, or in *limbo* once nobody holds them, until their restore finishes).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from hetero.engine.prefix_cache import PrefixCache, block_hash
from hetero.engine.request import Request, RequestStatus
from hetero.kv_tiers.blocks import TieredBlocks

if TYPE_CHECKING:
    from hetero.kv_tiers.policy import KVTiers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager(TieredBlocks):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: KVTiers | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cache = PrefixCache()
        self._live: dict[str, Request] = {}  # requests holding blocks
        # names of each live request's leading full blocks (the chain commit() extends)
        self._hashes: dict[str, list[bytes]] = {}
        self._copies: list[tuple[int, int]] = []
        self._init_tiers(tiers if enable_prefix_caching else None)

    # -- accounting ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take now: free ones and parked (evictable) ones."""
        return len(self._free) + self._cache.num_parked

    @property
    def num_cached_blocks(self) -> int:
        """Parked blocks: freed, still holding KV that a prefix hit can reuse."""
        return self._cache.num_parked

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- admission -------------------------------------------------------------------------------

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of req that a prefix hit would give it now (no side effects)."""
        return len(self._match(req)) * self.block_size

    def _match(self, req: Request) -> list[tuple[bytes, int | None]]:
        """(name, block) of the longest run of req's leading full blocks that the cache holds.

        block is None for a block a lower tier holds (restored if allocate takes the hit); the
        run stops before the first of those when the tiers' cost model says recomputing their
        tokens is faster than restoring them.

        At most (num_tokens - 1) // B blocks: at least one token must be computed to get the
        logits that choose the next token, so a prompt that is all hits (its length a multiple of
        B) backs off by a whole block. Backing off one token instead would mean writing that
        token's KV into a block other requests may be reading (a copy first); recomputing up to
        B tokens costs little next to the prompt.
        """
        if not self.enable_prefix_caching:
            return []
        bs, hits, prev = self.block_size, [], None
        tiers, lower = self.tiers, {"ram": 0, "disk": 0}
        for i in range((req.num_tokens - 1) // bs):
            h = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            block = self._cache.lookup(h)
            tier = None if block is not None or tiers is None else tiers.where(h)
            if block is None and tier is None:
                break
            if tier is not None:
                lower[tier] += 1
            hits.append((h, block))
            prev = h
        if (lower["ram"] or lower["disk"]) and not tiers.worth_restoring(  # type: ignore[union-attr]
            lower["ram"], lower["disk"], bs
        ):
            hits = hits[: next(i for i, (_, b) in enumerate(hits) if b is None)]
        return hits

    def allocate(self, req: Request, num_new_tokens: int | None = None) -> bool:
        """Give a request without KV (new, or preempted to be recomputed) its first blocks.

        Takes references on the longest cached prefix, then fresh blocks for `num_new_tokens`
        tokens after it (default: all the rest; the scheduler passes its chunk). Sets
        num_computed_tokens to the hit length, and num_cached_tokens too unless req was
        preempted (usage reports the prompt's hits of its first admission). Returns False,
        changing nothing, when the pool has too few blocks.
        """
        if req.request_id in self._live or req.block_table:
            raise ValueError(f"request {req.request_id!r} already holds KV blocks")
        hits = self._match(req)
        hit_tokens = len(hits) * self.block_size
        remaining = req.num_tokens - hit_tokens
        n = remaining if num_new_tokens is None else num_new_tokens
        if not 1 <= n <= remaining:
            raise ValueError(
                f"request {req.request_id!r}: num_new_tokens must be in 1..{remaining} "
                f"(after a prefix hit of {hit_tokens} tokens), got {n}"
            )
        lower = sum(1 for _, b in hits if b is None)
        num_new_blocks = self.blocks_for(hit_tokens + n) - len(hits)
        # parked now, live after (a block in limbo is not counted free, so it costs nothing)
        revived = sum(1 for _, b in hits if b is not None and self._cache.is_parked(b))
        if num_new_blocks + lower + revived > self.num_free_blocks:
            return False
        claimed = []
        if lower:  # pin RAM sources and read disk ones before _take can evict anything
            hits, claimed = self._claim(hits)
            hit_tokens = len(hits) * self.block_size
            num_new_blocks = self.blocks_for(hit_tokens + n) - len(hits)
        for _, b in hits:
            if b is not None:
                self._revive(b)
        table = [self._take() if b is None else b for _, b in hits]
        if claimed:
            self._restore(hits, table, claimed)
        req.block_table = table + [self._take() for _ in range(num_new_blocks)]
        req.num_computed_tokens = hit_tokens
        if req.status is not RequestStatus.PREEMPTED:
            req.num_cached_tokens = hit_tokens
        self._live[req.request_id] = req
        self._hashes[req.request_id] = [h for h, _ in hits]
        self._want_gaps(req)
        return True

    def _take(self) -> int:
        """A block for new KV, refcount 1: a free one, else the least recently parked one.

        An evicted block's data moves a tier down when there are lower tiers (queued op: the mover
        copies it out before the step writes into the block).
        """
        if self._free:
            block = self._free.popleft()
        else:
            block, name = self._cache.evict_named()
            if self.tiers is not None:
                self.tiers.evicted(block, name)
        self._ref[block] = 1
        return block

    def _revive(self, block: int) -> None:
        if self._ref[block] == 0:
            if block in self._limbo:
                self._limbo.remove(block)
            else:
                self._cache.unpark(block)
        self._ref[block] += 1
        if self.tiers is not None:
            self.tiers.stats.hits["device"] += 1

    # -- growth ----------------------------------------------------------------------------------

    def append_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Room for the KV of positions [computed, computed + n) of a request holding blocks.

        A block those positions fall in that another request shares (a fork's partial last
        block) is first copied: the request gets the copy and a copy instruction is queued for
        the KV pool (take_copies). Returns False, changing nothing, when the pool is short; the
        caller preempts someone and retries.
        """
        table = self._table_of(req)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return True
        end = req.num_computed_tokens + num_new_tokens
        first = req.num_computed_tokens // self.block_size
        last = min(len(table), self.blocks_for(end))
        shared = [i for i in range(first, last) if self._ref[table[i]] > 1]
        num_new_blocks = max(0, self.blocks_for(end) - len(table))
        if num_new_blocks + len(shared) > self.num_free_blocks:
            return False
        for i in shared:
            src, dst = table[i], self._take()
            self._ref[src] -= 1  # still >= 1: the other sharers keep the original
            table[i] = dst
            self._copies.append((src, dst))
        table.extend(self._take() for _ in range(num_new_blocks))
        return True

    def commit(self, req: Request) -> None:
        """Name the blocks that computed tokens filled since the last commit, for later hits."""
        if not self.enable_prefix_caching:
            return
        self._table_of(req)
        hashes, table, bs = self._hashes[req.request_id], req.block_table, self.block_size
        prev = hashes[-1] if hashes else None
        for i in range(len(hashes), req.num_computed_tokens // bs):
            prev = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            if self._cache.register(table[i], prev):  # a duplicate stays unnamed
                self._committed(table[i], prev)
            hashes.append(prev)

    def fork(self, parent: Request, child: Request) -> None:
        """Share parent's computed KV with child (n choices of one prompt), copy-on-write.

        child must hold no blocks and agree with parent on the computed tokens; it gets the
        blocks holding them, including a partial last block, which the first of the two to write
        into it copies (append_slots). Fork costs no free blocks.
        """
        ptable = self._table_of(parent)
        c = parent.num_computed_tokens
        if child.request_id in self._live or child.block_table:
            raise ValueError(f"request {child.request_id!r} already holds KV blocks")
        if child.num_tokens <= c or child.tokens(0, c) != parent.tokens(0, c):
            raise ValueError(
                f"fork {parent.request_id!r} -> {child.request_id!r}: the child must extend the "
                f"parent's {c} computed tokens by at least one token"
            )
        shared = ptable[: self.blocks_for(c)]
        for b in shared:
            self._ref[b] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = c
        child.num_cached_tokens = min(c, child.num_prompt_tokens)
        self._live[child.request_id] = child
        self._hashes[child.request_id] = self._hashes[parent.request_id][: c // self.block_size]

    def take_copies(self) -> list[tuple[int, int]]:
        """(src_block, dst_block) copies the KV pool must do before the step writes any KV.

        Read every source before writing any destination (gather, then scatter): a block freed
        after being a source may be a destination later in the same list.
        """
        copies, self._copies = self._copies, []
        return copies

    # -- release ---------------------------------------------------------------------------------

    def free(self, req: Request) -> None:
        """Drop req's references (finish, abort or preemption); its KV no longer counts.

        Blocks whose count reaches zero are parked if named, else freed. The table is walked
        tail first so a request's last blocks are evicted before its first ones: prefixes (the
        system prompt, earlier chat turns) are what later requests hit. Idempotent.
        """
        if req.request_id not in self._live:
            req.block_table = []
            return
        self._release(reversed(req.block_table))
        req.block_table = []
        req.num_computed_tokens = 0
        del self._live[req.request_id]
        del self._hashes[req.request_id]

    def trim(self, req: Request, num_tokens: int) -> None:
        """Drop req's blocks past those holding positions [0, num_tokens): the slots of
        speculative tokens that verification rejected. Only computed, accepted tokens are named
        (commit), so no dropped block carries a name for tokens that were never accepted."""
        table = self._table_of(req)
        if num_tokens < req.num_computed_tokens:
            raise ValueError(
                f"request {req.request_id!r}: cannot trim below its "
                f"{req.num_computed_tokens} computed tokens (asked {num_tokens})"
            )
        keep = self.blocks_for(num_tokens)
        self._release(reversed(table[keep:]))
        del table[keep:]

    def _release(self, blocks) -> None:
        """Drop one reference on each block: at zero a named block is parked, others freed."""
        released = set()
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                released.add(b)
                if b in self._loading:  # a restore still writes into it
                    self._limbo.add(b)
                elif self._cache.hash_of(b) is not None:
                    self._cache.park(b)
                else:
                    self._free.append(b)
        # a queued copy into a block that nobody holds any more is moot, and would race with a
        # later copy into the same block once it is reused
        self._copies = [(s, d) for s, d in self._copies if d not in released]

    def reset_prefix_cache(self) -> int:
        """Forget all parked blocks (live ones keep their names); returns how many."""
        blocks = self._cache.evict_all()
        self._free.extend(blocks)
        return len(blocks)

    # -- addressing ------------------------------------------------------------------------------

    def slot_mapping(self, req: Request, start: int, end: int) -> list[int]:
        """Flat KV slots of positions start..end-1 (block * block_size + offset)."""
        table, bs = req.block_table, self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise ValueError(
                f"positions {start}..{end} are outside request {req.request_id!r}'s "
                f"{len(table)} blocks ({len(table) * bs} slots)"
            )
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _table_of(self, req: Request) -> list[int]:
        if self._live.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id!r} holds no KV blocks (allocate it first)")
        return req.block_table

    # -- invariants ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (tests call it often)."""
        counts = [0] * self.num_blocks
        for rid, req in self._live.items():
            if len(set(req.block_table)) != len(req.block_table):
                raise AssertionError(f"{rid}: a block appears twice in {req.block_table}")
            if req.num_computed_tokens > len(req.block_table) * self.block_size:
                raise AssertionError(f"{rid}: computed tokens exceed its blocks")
            if len(self._hashes[rid]) > req.num_computed_tokens // self.block_size:
                raise AssertionError(f"{rid}: more block names than full computed blocks")
            for b, h in zip(req.block_table, self._hashes[rid], strict=False):
                if self._cache.hash_of(b) not in (None, h):
                    raise AssertionError(f"{rid}: block {b} is named for other tokens")
            for b in req.block_table:
                counts[b] += 1
        if counts != self._ref:
            raise AssertionError("reference counts differ from the block tables")
        free, parked, limbo = set(self._free), set(self._cache.parked_blocks()), self._limbo
        if len(free) != len(self._free) or free & parked or limbo & (free | parked):
            raise AssertionError("a block is listed twice among free, parked and limbo blocks")
        if any(self._ref[b] for b in free | parked | limbo):
            raise AssertionError("a referenced block is also free, parked or in limbo")
        used = sum(1 for r in self._ref if r > 0)
        if used + len(free) + len(parked) + len(limbo) != self.num_blocks:
            raise AssertionError("free + parked + limbo + used blocks != total")
        if not limbo <= set(self._loading) or set(self._loading) & (free | parked):
            raise AssertionError("a loading block is free or parked, or limbo is not loading")
        if self.tiers is not None:
            self.tiers.check()
        self._cache.check()
        if any(self._cache.hash_of(b) is not None for b in free):
            raise AssertionError("a free block still has a name")
        if any(self._ref[d] == 0 for _, d in self._copies):
            raise AssertionError("a queued copy writes into an unreferenced block")
