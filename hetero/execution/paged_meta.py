"""Tensor metadata of one step for the paged attention kernels, built once per step.

The Triton kernels take the block tables themselves (not per-position slot lists), so a step is
a handful of small tensors of fixed shape per batch size: what a CUDA graph needs to replay a
decode step with new values.

    block_tables [B, max_blocks] int32   blocks of each sequence (0-padded)
    seq_lens     [B] int32               context length after this step's tokens
    q_start_loc  [B + 1] int32           row of each sequence's first query in the [T] batch

A CUDA-graph step runs prompt chunks as one-query rows (engine/cuda_graph.py), each with its own
table row and length. Alone, each such row would read its whole context: `tiles` (RowTiles)
lets the kernels take runs of ROW_TILE rows of one chunk together, reading each key once a tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_TILE = 32  # one-query rows of a prompt chunk that attend together (RowTiles)


@dataclass
class RowTiles:
    """Which one-query rows attend as tiles: tile i is rows i*rows .. (i+1)*rows - 1, and a row
    belongs to its tile when it is a prompt row of the same chunk as the tile's first row.

    decode_lens [B] int32   the row's context length, 0 where its tile attends for it
    tile_lens   [B] int32   the row's context length where its tile attends for it, else 0
    """

    decode_lens: torch.Tensor
    tile_lens: torch.Tensor
    rows: int = ROW_TILE


def split_row_tiles(
    lens: torch.Tensor, chunk_ids: torch.Tensor, rows: int = ROW_TILE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_lens, tile_lens) of RowTiles from each row's context length and chunk id (the
    prompt chunk a row belongs to; -1 for decode rows and padding)."""
    first = chunk_ids[torch.arange(len(chunk_ids)) // rows * rows]
    tiled = (chunk_ids >= 0) & (chunk_ids == first)
    zero = torch.zeros_like(lens)
    return torch.where(tiled, zero, lens), torch.where(tiled, lens, zero)


@dataclass
class TensorMeta:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_start_loc: torch.Tensor
    max_q_len: int  # host ints: grid sizes (a captured graph fixes them at capture)
    max_seq_len: int
    block_size: int
    tiles: RowTiles | None = None  # a graph step's prompt rows (module docstring)
    # rows may be one sequence's (a graph step's guesses or prompt chunk, each row a one-query
    # "sequence"): a row reads keys that other rows of the step write, so they must all be
    # stored before any row attends (no launch that stores and attends in one)
    shared: bool = False

    def to(self, device: torch.device) -> TensorMeta:
        bt, lens, starts = (
            t.to(device, non_blocking=True)
            for t in (self.block_tables, self.seq_lens, self.q_start_loc)
        )
        tiles = self.tiles
        if tiles is not None:
            dl, tl = (t.to(device, non_blocking=True) for t in (tiles.decode_lens, tiles.tile_lens))
            tiles = RowTiles(dl, tl, tiles.rows)
        return TensorMeta(
            bt, lens, starts, self.max_q_len, self.max_seq_len, self.block_size, tiles,
            self.shared,
        )  # fmt: skip


def tensor_meta(
    tables: list[list[int]], seq_lens: list[int], q_lens: list[int], block_size: int
) -> TensorMeta:
    """From host lists: each sequence's block table, context length and new-token count."""
    nb = [-(-n // block_size) for n in seq_lens]
    width = max(nb, default=0) or 1
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, (table, n) in enumerate(zip(tables, nb)):
        bt[b, :n] = torch.tensor(table[:n], dtype=torch.int32)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return TensorMeta(
        bt,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
        max(q_lens, default=0),
        max(seq_lens, default=0),
        block_size,
    )


def decode_slots_from_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's decode view, computed on the device without host values:
    slots [B, L] (L = max_blocks * block_size) of every position, mask [B, L] where real.

    Positions past a sequence's length read its last written slot, not whatever the table's
    padding or an unwritten slot holds: the mask drops them, but a NaN read there would still
    reach the output (0 * NaN in the weighted sum of V)."""
    pos = torch.arange(block_tables.shape[1] * block_size, device=block_tables.device)
    mask = pos[None, :] < seq_lens[:, None]
    read = torch.minimum(pos[None, :], (seq_lens.long() - 1).clamp_min(0)[:, None])  # [B, L]
    blocks = block_tables.long().gather(1, read // block_size)
    return blocks * block_size + read % block_size, mask
