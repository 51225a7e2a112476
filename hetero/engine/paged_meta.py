"""Tensor metadata of one step for the paged attention kernels, built once per step.

The Triton kernels take the block tables themselves (not per-position slot lists), so a step is
a handful of small tensors of fixed shape per batch size: what a CUDA graph needs to replay a
decode step with new values.

    block_tables [B, max_blocks] int32   blocks of each sequence (0-padded)
    seq_lens     [B] int32               context length after this step's tokens
    q_start_loc  [B + 1] int32           row of each sequence's first query in the [T] batch
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TensorMeta:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_start_loc: torch.Tensor
    max_q_len: int  # host ints: grid sizes (a captured graph fixes them at capture)
    max_seq_len: int
    block_size: int

    def to(self, device: torch.device) -> TensorMeta:
        bt, lens, starts = (
            t.to(device, non_blocking=True)
            for t in (self.block_tables, self.seq_lens, self.q_start_loc)
        )
        return TensorMeta(bt, lens, starts, self.max_q_len, self.max_seq_len, self.block_size)


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
