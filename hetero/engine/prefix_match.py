"""The longest prefix hit a request can take, over every KV cache group (kv_groups.py).

A prompt's leading full blocks are named by a chain of hashes (prefix_cache.py); each group's
block for run i has its own name (kv_groups.group_name). A hit of n blocks lets the request skip
computing positions 0 .. nB - 1, so the queries from nB on must find in the cache:

    full attention      the blocks 0 .. n - 1, all of them
    window w            the blocks of positions nB - w + 1 .. nB - 1 only: the last
                        K = ceil((w - 1) / B) blocks, n - K .. n - 1 (all n when n < K)

Full blocks are found as a chain (a hit on run i implies runs 0 .. i - 1 were cached once), so
the full groups give the longest candidate n; a window group then takes the largest n' <= n whose
last K blocks it holds (vLLM's sliding-window hit: scan from the right for K in a row), which may
be shorter, or none; with several window groups until every group agrees.

`locate(name)` says where a named block is: a device block id, a lower tier ("ram", "disk"), or
None (nowhere). The block manager asks twice when the lower tiers' blocks are not worth restoring
(device blocks only), and again with the claimed ones when a restore could not claim them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetero.engine.kv_groups import cdiv, group_name
from hetero.engine.prefix_cache import PrefixCache, block_hash

if TYPE_CHECKING:
    from hetero.engine.request import Request
    from hetero.kv_tiers.policy import KVTiers

Locate = Callable[[bytes], "int | str | None"]


@dataclass(frozen=True, slots=True)
class HitBlock:
    group: int
    index: int  # the block's position in the request's table
    name: bytes  # the group's name of the block
    where: int | str  # a device block id, or the lower tier ("ram", "disk") that holds it

    @property
    def block(self) -> int | None:
        return self.where if isinstance(self.where, int) else None


@dataclass
class PrefixHit:
    """n blocks of hit; `blocks`: what each group takes, by index then group; `chain`: the run
    names of the request's leading full blocks that were looked up (hit or not)."""

    n: int = 0
    blocks: list[HitBlock] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)

    @property
    def lower(self) -> list[HitBlock]:
        """The blocks a lower tier holds (restored into fresh device blocks if taken)."""
        return [b for b in self.blocks if b.block is None]

    def in_tier(self, tier: str) -> int:
        return sum(1 for b in self.blocks if b.where == tier)


def match_prefix(
    names: Iterable[bytes], windows: tuple[int, ...], block_size: int, locate: Locate
) -> PrefixHit:
    """The longest hit over the run names `names` (lazily hashed: the scan stops at the first
    run a full group lacks) that every group of `windows` holds what it needs of."""
    memo: dict[bytes, int | str | None] = {}

    def find(name: bytes) -> int | str | None:
        if name not in memo:
            memo[name] = locate(name)
        return memo[name]

    full = 0 in windows
    chain: list[bytes] = []
    for h in names:
        chain.append(h)
        if full and find(h) is None:
            break
    n = len(chain)
    if full:
        n = next((i for i, h in enumerate(chain) if find(h) is None), n)
    while True:  # each window group may shorten n; repeat until all of them hold it
        m = n
        for w in windows:
            if w:
                m = _window_fit(chain, w, m, block_size, find)
        if m == n:
            break
        n = m
    blocks = []
    for i in range(n):
        for g, w in enumerate(windows):
            if i >= n - window_blocks(w, block_size, n):
                name = group_name(w, chain[i])
                where = find(name)
                assert where is not None  # what the scans above found
                blocks.append(HitBlock(g, i, name, where))
    return PrefixHit(n, blocks, chain)


def window_blocks(window: int, block_size: int, n: int) -> int:
    """Of a hit of n blocks, how many the group needs: all for full attention, else the last
    ceil((window - 1) / B) (positions nB - window + 1 .. nB - 1), at most n."""
    return n if not window else min(n, cdiv(window - 1, block_size))


def _window_fit(chain: list[bytes], window: int, n: int, block_size: int, find) -> int:
    """The largest n' <= n whose last window_blocks(n') blocks the window group holds."""
    k = cdiv(window - 1, block_size)
    if k == 0:
        return n
    run = 0  # blocks found in a row, from block i up
    for i in range(n - 1, -1, -1):
        if find(group_name(window, chain[i])) is None:
            run = 0
            continue
        run += 1
        if run == k:
            return i + k
    return run  # fewer than k blocks from block 0 on, all found (or none)


class PrefixMatching:
    """Mixed into BlockManager: the hit a request would take now, and what it costs."""

    block_size: int
    windows: tuple[int, ...]
    enable_prefix_caching: bool
    tiers: KVTiers | None
    _cache: PrefixCache
    blocks_for: Callable[[int], int]

    def _match(self, req: Request) -> PrefixHit:
        """The longest run of req's leading full blocks every group holds what it needs of
        (match_prefix), in the device pool or a lower tier (restored if allocate takes the
        hit); device blocks only when the tiers' cost model says recomputing the lower tiers'
        tokens is faster than restoring them.

        At most (num_tokens - 1) // B blocks: at least one token must be computed to get the
        logits that choose the next token, so a prompt that is all hits (its length a multiple of
        B) backs off by a whole block. Backing off one token instead would mean writing that
        token's KV into a block other requests may be reading (a copy first); recomputing up to
        B tokens costs little next to the prompt.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        bs, tiers = self.block_size, self.tiers
        hit = match_prefix(self._run_names(req), self.windows, bs, self._locate)
        if hit.lower and not tiers.worth_restoring(  # type: ignore[union-attr]
            hit.in_tier("ram"), hit.in_tier("disk"), bs
        ):
            hit = match_prefix(hit.chain, self.windows, bs, self._cache.lookup)
        return hit

    def _run_names(self, req: Request) -> Iterator[bytes]:
        """The names of req's leading full blocks, hashed as they are asked for."""
        bs, prev = self.block_size, None
        for i in range((req.num_tokens - 1) // bs):
            prev = block_hash(prev, req.tokens(i * bs, (i + 1) * bs))
            yield prev

    def _locate(self, name: bytes) -> int | str | None:
        """The device block named `name`, else the lower tier holding it, else None."""
        block = self._cache.lookup(name)
        if block is not None or self.tiers is None:
            return block
        return self.tiers.where(name)

    def _cost(self, hit: PrefixHit, n: int) -> int:
        """Free blocks allocate takes for `hit` and n new tokens: fresh ones for the new tokens
        in every group and for the lower tiers' hits, and the parked hits it revives (a block in
        limbo is not counted free, so it costs nothing)."""
        fresh = self.blocks_for(hit.n * self.block_size + n) - hit.n
        revived = sum(
            1 for b in hit.blocks if b.block is not None and self._cache.is_parked(b.block)
        )
        return fresh * len(self.windows) + len(hit.lower) + revived
