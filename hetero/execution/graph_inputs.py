"""The decode graphs' static inputs (cuda_graph.py) as views of one device arena, refreshed each
step from a host mirror in one copy.

A captured graph reads its inputs at fixed addresses, so they are allocated once, before
capture, and only ever written in place. All of them live in one uint8 device arena:

    int64 [3 + G, R]            tokens, positions, logit_rows, then the slots of each of the G
                                KV cache groups with layers here
    int32 [3, R]                seq_lens, decode_lens, tile_lens
    int32 [Bmax, max_blocks]    the block tables, one region per group

R is Bmax rounded up to 64 (every row 256-byte aligned, as a tensor of its own would be), and
each region starts 256-byte aligned. A host mirror has the same layout. A step of bucket b
writes rows [:b] of the mirror with plain Python lists and numpy (small sizes: torch's per-call
overhead would dominate), then one copy moves the mirror's bytes from the arena's start through
row b of the first group's tables; each further group's tables take one more copy of b rows.

Rows past b keep whatever the mirror last held there (no graph of bucket b reads them); rows
[:b] are written whole. A block-table row is its table, then zeros to max_blocks: each mirror
remembers the table each row holds, so a row is written only when its table changed (a decode's
grows by one block every block_size steps) and only a stale tail is zeroed, never max_blocks.

Two mirrors alternate (pinned on CUDA: the copy is asynchronous and reads the mirror later).
Each records an event after its copy, and a step waits on it before writing that mirror again,
so a step never overwrites bytes that a copy still in flight reads.
"""

from __future__ import annotations

import numpy as np
import torch

from hetero.engine.scheduler import ScheduledRequest

ALIGN = 256  # bytes: each region's (and each int64/int32 row's) alignment


def is_decode(s: ScheduledRequest) -> bool:
    """One known token (the last), then any guesses: a row each, no prefill chunk."""
    return s.produces_token and s.num_new_tokens == 1 + len(s.spec_ids)


def _up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class _Mirror:
    """A host copy of the arena's layout, its numpy views, and its tables' row extents."""

    def __init__(self, init: torch.Tensor, inputs: GraphInputs, pin: bool) -> None:
        self.host = init.clone().pin_memory() if pin else init.clone()
        raw = self.host.numpy()
        r, k64, bmax, mb = inputs.row, inputs.k64, inputs.bmax, inputs.max_blocks
        self.i64 = raw[: k64 * r * 8].view(np.int64).reshape(k64, r)
        self.i32 = raw[inputs.off32 : inputs.off32 + 3 * r * 4].view(np.int32).reshape(3, r)
        self.tables = [
            raw[o : o + bmax * mb * 4].view(np.int32).reshape(bmax, mb) for o in inputs.offs
        ]
        # the table row i of group j holds: held[j][i], then zeros (the arena starts zeroed)
        self.held: list[list[list[int] | tuple]] = [[()] * bmax for _ in self.tables]
        self.event: torch.cuda.Event | None = None
        self.spans: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # bucket: (arena, host)


class GraphInputs:
    def __init__(
        self,
        bmax: int,
        max_batch: int,
        max_blocks: int,
        groups: list[int],
        n_groups: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """groups: the KV cache groups with layers here, of n_groups in the model."""
        self.bmax, self.max_batch, self.max_blocks = bmax, max_batch, max_blocks
        self.groups, self.block_size, self.device = list(groups), block_size, device
        self.row = r = _up(bmax, 64)
        self.k64 = k64 = 3 + len(self.groups)
        self.off32 = _up(k64 * r * 8)
        table_bytes = _up(bmax * max_blocks * 4)
        self.offs = [_up(self.off32 + 3 * r * 4) + j * table_bytes for j in range(len(groups))]
        size = self.offs[-1] + table_bytes if self.offs else self.off32 + 3 * r * 4
        self.arena = arena = torch.zeros(size, dtype=torch.uint8, device=device)
        i64 = arena[: k64 * r * 8].view(torch.int64).view(k64, r)
        i32 = arena[self.off32 : self.off32 + 3 * r * 4].view(torch.int32).view(3, r)
        self.tokens, self.positions = i64[0, :bmax], i64[1, :bmax]
        self.logit_rows = i64[2, :max_batch]
        self.seq_lens, self.decode_lens, self.tile_lens = (i32[i, :bmax] for i in range(3))
        here = {g: j for j, g in enumerate(self.groups)}
        self.slots = [i64[3 + here[g], :bmax] if g in here else None for g in range(n_groups)]
        self.block_tables = [
            arena[self.offs[here[g]] : self.offs[here[g]] + bmax * max_blocks * 4]
            .view(torch.int32)
            .view(bmax, max_blocks)
            if g in here
            else None
            for g in range(n_groups)
        ]
        for t in self.slots:
            if t is not None:
                t.fill_(-1)
        self.logit_rows.copy_(torch.arange(max_batch))
        init = arena.cpu()
        pin = device.type == "cuda"
        self._mirrors = [_Mirror(init, self, pin), _Mirror(init, self, pin)]
        self._turn = 0

    def fill(self, sched: list[ScheduledRequest], b: int, tile: int) -> tuple[int, int]:
        """The step's host values into rows [:b] (rows n .. b - 1 padding: token and position 0,
        slot -1, seq_len 0, a zero block-table row; logit_rows past the producing rows 0), and
        the prompt rows' RowTiles where tile > 1. Returns (rows that produce a token, rows that
        attend in tiles)."""
        m = self._mirrors[self._turn]
        self._turn ^= 1
        if m.event is not None:
            m.event.synchronize()  # its last copy has read it
        bs, mb, groups = self.block_size, self.max_blocks, self.groups
        tokens: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        produce: list[int] = []
        slots: list[list[int]] = [[] for _ in groups]
        chunk: list[int] | None = [] if tile > 1 else None
        row = 0
        for i, s in enumerate(sched):
            pos, n, spec = s.start_pos, s.num_new_tokens, s.spec_ids
            end = pos + n
            tokens += s.req.tokens(pos, end - len(spec))
            if spec:
                tokens += spec
            width = (end - 1) // bs + 1
            if n == 1:
                positions.append(pos)
                lens.append(end)
                k = min(pos // bs, mb - 1)
                for j, g in enumerate(groups):
                    table = s.req.block_tables[g][:width]
                    nt = len(table)
                    held = m.held[j]
                    if held[row] != table:  # (a decode's table changes once every bs steps)
                        t, stale = m.tables[j], len(held[row])
                        t[row, :nt] = table
                        if stale > nt:
                            t[row, nt:stale] = 0
                        held[row] = table
                    slots[j].append((table[k] if k < nt else 0) * bs + pos % bs)
            else:
                positions += range(pos, end)
                lens += range(pos + 1, end + 1)
                p = np.arange(pos, end)
                k, off = np.minimum(p // bs, mb - 1), p % bs
                for j, g in enumerate(groups):
                    table = s.req.block_tables[g][:width]
                    nt = len(table)
                    t, held = m.tables[j], m.held[j]
                    t[row : row + n, :nt] = table
                    stale = max(map(len, held[row : row + n]))
                    if stale > nt:
                        t[row : row + n, nt:stale] = 0
                    held[row : row + n] = [table] * n
                    # the row's table, zero past nt: what a gather from the zero-padded table reads
                    slots[j] += (t[row, k].astype(np.int64) * bs + off).tolist()
            if chunk is not None:
                chunk += [-1 if is_decode(s) else i] * n
            row += n
            if s.produces_token:
                produce += range(row - 1 - len(spec), row)
        lc = min(b, self.max_batch)
        if row > b or len(produce) > lc:
            raise ValueError(f"{row} rows ({len(produce)} producing) do not fit bucket {b}")
        pad = b - row
        if pad:
            zeros = [0] * pad
            tokens += zeros
            positions += zeros
            lens += zeros
            for t, held in zip(m.tables, m.held, strict=True):
                stale = max(map(len, held[row:b]))
                if stale:
                    t[row:b, :stale] = 0
                    held[row:b] = [()] * pad
            for sl in slots:
                sl += [-1] * pad
        m.i64[:, :b] = [tokens, positions, produce + [0] * (b - len(produce)), *slots]
        m.i32[0, :b] = lens
        tiled = 0
        if chunk is not None:
            tiled = self._tiles(m, chunk + [-1] * pad, b, tile)
        self._copy(m, b)
        return len(produce), tiled

    @staticmethod
    def _tiles(m: _Mirror, chunk: list[int], b: int, tile: int) -> int:
        """paged_meta.split_row_tiles in numpy: a row attends in its tile when it is a prompt
        row of the chunk the tile's first row belongs to."""
        ids = np.asarray(chunk)
        first = np.repeat(ids[::tile], tile)[:b]
        tiled = (ids >= 0) & (ids == first)
        lens = m.i32[0, :b]
        m.i32[1, :b] = np.where(tiled, 0, lens)
        m.i32[2, :b] = np.where(tiled, lens, 0)
        return int(np.count_nonzero(m.i32[2, :b]))

    def _copy(self, m: _Mirror, b: int) -> None:
        """The mirror's bytes through row b of the first group's tables in one copy, b rows of
        each further group's in one more; then the event that says the mirror was read."""
        pairs = m.spans.get(b)
        if pairs is None:  # (the views made once a bucket: a few microseconds a step)
            rows = b * self.max_blocks * 4
            spans = [(0, self.offs[0] + rows if self.offs else self.off32 + 3 * self.row * 4)]
            spans += [(o, o + rows) for o in self.offs[1:]]
            pairs = m.spans[b] = [(self.arena[lo:hi], m.host[lo:hi]) for lo, hi in spans]
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            if m.event is None:
                m.event = torch.cuda.Event()
            m.event.record(torch.cuda.current_stream(self.device))
