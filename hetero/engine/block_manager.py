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

A model with sliding-window layers has a KV cache group for them (kv_groups.py): a request holds
one table per group, all of one length, and a window group's table holds the null block where
its blocks fell out of the window (here a window of B positions, positions 0 .. 3B+5 computed):

    positions  0 ...... B-1 | B ..... 2B-1 | 2B ..... 3B-1 | 3B .. 3B+5 . . |
    full       [     17     ,      4       ,       9       ,      12        ]
    window     [    null    ,     null     ,       3       ,      21        ]

Before each step (append_slots) a window group releases the blocks that lie wholly before the
window of the block boundary the step starts in (_slide): parked when named, so a later prefix
hit may still find them (prefix_match.py says which blocks a hit needs of each group).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hetero.engine.block_checks import check_blocks
from hetero.engine.kv_groups import blocks_needed, cdiv, first_needed, group_name
from hetero.engine.prefix_cache import PrefixCache, block_hash
from hetero.engine.prefix_match import PrefixMatching
from hetero.engine.request import Request, RequestStatus
from hetero.kv_tiers.blocks import TieredBlocks

if TYPE_CHECKING:
    from hetero.kv_tiers.policy import KVTiers


class BlockManager(PrefixMatching, TieredBlocks):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: KVTiers | None = None,
        windows: tuple[int, ...] = (0,),
        window_slack: int = 0,
    ):
        """windows: each KV cache group's attention window (kv_groups.KVGroups.windows; one
        group of full attention by default); window_slack: positions a caller may roll back
        num_computed_tokens by (a draft model's rejected guesses), whose window blocks are kept."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows, self.window_slack = tuple(windows), window_slack
        self.null_block = num_blocks  # a window table's entry where it holds no block
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

    def blocks_needed(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks, all groups together, a sequence of num_tokens holds at once when a
        step computes up to step_tokens of it (kv_groups.blocks_needed)."""
        return blocks_needed(
            self.windows, num_tokens, step_tokens, self.block_size, self.window_slack
        )

    def max_tokens(self, step_tokens: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) the whole pool holds alone."""
        lo, hi = 0, self.blocks_for(limit)  # blocks of one table; blocks_needed grows with them
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = self.blocks_needed(mid * self.block_size, step_tokens) <= self.num_blocks
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        return min(limit, lo * self.block_size)

    # -- admission -------------------------------------------------------------------------------

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of req that a prefix hit would give it now (no side effects)."""
        return self._match(req).n * self.block_size

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
        hit = self._match(req)
        remaining = req.num_tokens - hit.n * self.block_size
        n = remaining if num_new_tokens is None else num_new_tokens
        if not 1 <= n <= remaining:
            raise ValueError(
                f"request {req.request_id!r}: num_new_tokens must be in 1..{remaining} "
                f"(after a prefix hit of {hit.n * self.block_size} tokens), got {n}"
            )
        if self._cost(hit, n) > self.num_free_blocks:
            return False
        claimed = []
        if hit.lower:  # pin RAM sources and read disk ones before _take can evict anything
            hit, claimed = self._claim(hit, n)
            if hit is None:
                return False
        for b in hit.blocks:
            if b.block is not None:
                self._revive(b.block)
        placed = {
            (b.group, b.index): b.block if b.block is not None else self._take() for b in hit.blocks
        }
        if claimed:
            self._restore([(b.name, placed[b.group, b.index]) for b in hit.lower], claimed)
        grow = self.blocks_for(hit.n * self.block_size + n) - hit.n
        req.block_tables = [
            [placed.get((g, i), self.null_block) for i in range(hit.n)]
            + [self._take() for _ in range(grow)]
            for g in range(len(self.windows))
        ]
        req.num_computed_tokens = hit.n * self.block_size
        if req.status is not RequestStatus.PREEMPTED:
            req.num_cached_tokens = req.num_computed_tokens
        self._live[req.request_id] = req
        self._hashes[req.request_id] = hit.chain[: hit.n]
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

        First the window groups release the blocks wholly before the window of position
        `computed` (_slide). A block those positions fall in that another request shares (a
        fork's partial last block) is then copied: the request gets the copy and a copy
        instruction is queued for the KV pool (take_copies). Returns False, changing nothing
        more, when the pool is short; the caller preempts someone and retries.
        """
        tables = self._tables_of(req)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return True
        self._slide(req)
        end = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        first = req.num_computed_tokens // self.block_size
        shared = [
            (t, i) for t in tables for i in range(first, min(len(t), end)) if self._ref[t[i]] > 1
        ]
        grow = max(0, end - len(tables[0]))
        if grow * len(tables) + len(shared) > self.num_free_blocks:
            return False
        for t, i in shared:
            src, dst = t[i], self._take()
            self._ref[src] -= 1  # still >= 1: the other sharers keep the original
            t[i] = dst
            self._copies.append((src, dst))
        for t in tables:
            t.extend(self._take() for _ in range(grow))
        return True

    def _slide(self, req: Request) -> None:
        """Release each window group's blocks that lie wholly before the window of the block
        boundary at or before num_computed_tokens (less window_slack): no query from there on
        reads them, and a later request that continues this one (the next turn of a chat) finds
        the window its hit ends with, up to the last full block. Released blocks are a prefix
        of the table, so the walk stops at the first null one."""
        bs, null = self.block_size, self.null_block
        edge = req.num_computed_tokens // bs * bs
        for w, t in zip(self.windows, req.block_tables):
            i = min(first_needed(w, edge, bs, self.window_slack), len(t)) - 1
            gone = []
            while i >= 0 and t[i] != null:
                gone.append(t[i])
                t[i] = null
                i -= 1
            self._release(reversed(gone))

    def commit(self, req: Request) -> None:
        """Name the blocks that computed tokens filled since the last commit, for later hits:
        each group's block by the group's name of its tokens (kv_groups.group_name)."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables_of(req)
        hashes, bs = self._hashes[req.request_id], self.block_size
        prev = hashes[-1] if hashes else None
        for i in range(len(hashes), req.num_computed_tokens // bs):
            prev = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            for w, t in zip(self.windows, tables):
                name = group_name(w, prev)
                if t[i] != self.null_block and self._cache.register(t[i], name):
                    self._committed(t[i], name)  # a duplicate stays unnamed
            hashes.append(prev)

    def fork(self, parent: Request, child: Request) -> None:
        """Share parent's computed KV with child (n choices of one prompt), copy-on-write.

        child must hold no blocks and agree with parent on the computed tokens; it gets the
        blocks holding them, including a partial last block, which the first of the two to write
        into it copies (append_slots). Fork costs no free blocks.
        """
        ptables = self._tables_of(parent)
        c = parent.num_computed_tokens
        if child.request_id in self._live or child.block_table:
            raise ValueError(f"request {child.request_id!r} already holds KV blocks")
        if child.num_tokens <= c or child.tokens(0, c) != parent.tokens(0, c):
            raise ValueError(
                f"fork {parent.request_id!r} -> {child.request_id!r}: the child must extend the "
                f"parent's {c} computed tokens by at least one token"
            )
        child.block_tables = [t[: self.blocks_for(c)] for t in ptables]
        for b in self._held(b for t in child.block_tables for b in t):
            self._ref[b] += 1
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

        Blocks whose count reaches zero are parked if named, else freed. The tables are walked
        tail first so a request's last blocks are evicted before its first ones: prefixes (the
        system prompt, earlier chat turns) are what later requests hit. Idempotent.
        """
        if req.request_id not in self._live:
            req.block_tables = []
            return
        tables = req.block_tables
        self._release(self._held([t[i] for i in reversed(range(len(tables[0]))) for t in tables]))
        req.block_tables = []
        req.num_computed_tokens = 0
        del self._live[req.request_id]
        del self._hashes[req.request_id]

    def trim(self, req: Request, num_tokens: int) -> None:
        """Drop req's blocks past those holding positions [0, num_tokens): the slots of
        speculative tokens that verification rejected. Only computed, accepted tokens are named
        (commit), so no dropped block carries a name for tokens that were never accepted."""
        tables = self._tables_of(req)
        if num_tokens < req.num_computed_tokens:
            raise ValueError(
                f"request {req.request_id!r}: cannot trim below its "
                f"{req.num_computed_tokens} computed tokens (asked {num_tokens})"
            )
        keep = self.blocks_for(num_tokens)
        for t in tables:
            self._release(self._held(reversed(t[keep:])))
            del t[keep:]

    def _held(self, entries: Iterable[int]) -> list[int]:
        """The blocks among table entries (the null block left out)."""
        return [b for b in entries if b != self.null_block]

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

    def slot_mapping(self, req: Request, start: int, end: int, group: int = 0) -> list[int]:
        """Flat KV slots of positions start..end-1 in `group`'s table (block * B + offset)."""
        table, bs = req.block_tables[group], self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise ValueError(
                f"positions {start}..{end} are outside request {req.request_id!r}'s "
                f"{len(table)} blocks ({len(table) * bs} slots)"
            )
        if start < end and table[start // bs] == self.null_block:  # nulls lead the table
            raise ValueError(f"positions {start}..{end} reach blocks out of the window")
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tables_of(self, req: Request) -> list[list[int]]:
        if self._live.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id!r} holds no KV blocks (allocate it first)")
        return req.block_tables

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (tests call it often)."""
        check_blocks(self)
