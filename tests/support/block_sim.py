"""A block manager that checks its invariants after every call, and a simulated KV pool.

Shared by the block manager tests: each slot of SimKV holds the (position, token) written into
it, which proves that what a request reads back through its block table is its own tokens,
whatever sharing, eviction and copying happened on the way.
"""

from __future__ import annotations

from hetero.engine.block_manager import BlockManager
from hetero.engine.request import Request


class CheckedBlockManager(BlockManager):
    """The real manager, checking its invariants after every mutating call."""

    def allocate(self, req, num_new_tokens=None):
        ok = super().allocate(req, num_new_tokens)
        self.check()
        return ok

    def append_slots(self, req, num_new_tokens):
        ok = super().append_slots(req, num_new_tokens)
        self.check()
        return ok

    def commit(self, req):
        super().commit(req)
        self.check()

    def fork(self, parent, child):
        super().fork(parent, child)
        self.check()

    def free(self, req):
        super().free(req)
        self.check()


class SimKV:
    """A KV pool whose slots hold (position, token, group): enough to catch any misplaced block.

    Every KV cache group's table is written (bm.windows); a read checks each group's positions a
    query at the end still sees: all of them, or a window group's last `window` - 1 ones."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: list[tuple[int, int, int] | None] = [None] * (
            (bm.num_blocks + 1) * bm.block_size
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.bm.block_size
        gathered = [self.slots[s * bs : (s + 1) * bs] for s, _ in copies]  # gather, then scatter
        for (_, d), data in zip(copies, gathered, strict=True):
            self.slots[d * bs : (d + 1) * bs] = data

    def write(self, req: Request, start: int, n: int) -> None:
        for g in range(len(self.bm.windows)):
            slots = self.bm.slot_mapping(req, start, start + n, g)
            for p, (slot, tok) in enumerate(zip(slots, req.tokens(start, start + n), strict=True)):
                self.slots[slot] = (start + p, tok, g)

    def read(self, req: Request, end: int) -> list[int]:
        """req's tokens [0, end) as the full groups read them back (with none: the window's)."""
        out = None
        for g, w in enumerate(self.bm.windows):
            start = max(0, end - w + 1) if w else 0
            seen = [self.slots[s] for s in self.bm.slot_mapping(req, start, end, g)]
            where = [(s[0], s[2]) if s else None for s in seen]
            assert where == [(p, g) for p in range(start, end)], "a slot of another position"
            assert [s[1] for s in seen] == req.tokens(start, end)  # type: ignore[index]
            if out is None or not w:
                out = [s[1] for s in seen]  # type: ignore[index]
        return out or []


def compute(bm: BlockManager, kv: SimKV | None, req: Request, n: int) -> None:
    """One model step over req's next n tokens: slots, copies, KV writes, commit."""
    assert bm.append_slots(req, n)
    if kv is not None:
        kv.copy_blocks(bm.take_copies())
        kv.write(req, req.num_computed_tokens, n)
    req.num_computed_tokens += n
    bm.commit(req)
    if kv is not None:
        c = req.num_computed_tokens
        got = kv.read(req, c)  # all of them; a model of windows only: the window's
        assert got == req.tokens(c - len(got), c)


def prefill(bm: BlockManager, req: Request, kv: SimKV | None = None) -> None:
    """Admit req and compute its whole prompt (after whatever prefix hit it gets)."""
    assert bm.allocate(req)
    compute(bm, kv, req, req.num_tokens - req.num_computed_tokens)


def snapshot(bm: BlockManager, *reqs: Request) -> tuple:
    return (
        bm.num_free_blocks,
        bm.num_cached_blocks,
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        [(list(r.block_table), r.num_computed_tokens, r.num_cached_tokens) for r in reqs],
        bm.take_copies(),
    )
