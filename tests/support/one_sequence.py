"""One sequence over a paged KV pool of a chosen dtype, fed token by token.

For measuring what a KV dtype does to the logits (teacher-forced comparisons) without the
scheduler: blocks 0, 1, 2 ... hold the sequence in order.
"""

from __future__ import annotations

import torch

from hetero.execution.kv_pool import KVPool
from hetero.execution.runner import PagedAttention, PagedMeta
from hetero.model.forward_batch import ForwardBatch


class OneSequence:
    """A single sequence over a paged pool of one dtype (blocks 0, 1, 2 ... in order)."""

    def __init__(self, model, kv_dtype: str, max_len: int, block_size: int = 16):
        n_blocks = -(-max_len // block_size)
        self.model, self.pos = model, 0
        self.pool = KVPool(model.config, model.config.n_layers, n_blocks, block_size, kv_dtype)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; logits [V] of the last one."""
        n, start = len(tokens), self.pos
        slots = torch.arange(start + n)
        meta = PagedMeta([0], [n], [slots])
        attn = PagedAttention(self.pool, 0, slots[start:], meta, self.model.config.head_dim**-0.5)
        batch = ForwardBatch(torch.arange(start, start + n), torch.tensor([n - 1]), attn)
        self.pos += n
        return self.model(torch.tensor(tokens), batch)[0]
