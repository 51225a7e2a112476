"""KV cache groups: the layers that share one block table, one group per attention window.

A model whose layers all attend to the whole context has one group (window 0) and one block table
per request, as always. A model with sliding-window layers (gpt-oss: every other layer, a window
of 128 tokens) has a group for them too: a window layer reads only the last `window` positions'
KV, so its blocks are freed as the window moves past them (block_manager.py) while the full
layers keep every block. Half the KV of a long gpt-oss sequence is then a few blocks.

The groups draw their blocks from one pool of block ids (vLLM's hybrid KV cache manager): block b
holds, for B positions, the KV of every layer of the group that holds b. The pool lays each
group's layers on the same layer slots, so a block costs max(group sizes) layers, not n_layers:

    layer       0   1   2   3   4   5          (gpt-oss: w = window 128, f = full)
    window      w   f   w   f   w   f
    group       1   0   1   0   1   0          group 0: window 0, group 1: window 128
    slot        0   0   1   1   2   2          pool: 3 layer slots a block (not 6)

A window group's table keeps an entry for every block position; where its block fell out of the
window (or a prefix hit did not need it) the entry is the null block, `num_blocks`: one block past
the usable ones, zeroed in every pool, so a kernel that reads a whole key tile at the window's
edge reads finite zeros there, which the window masks out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroups:
    """windows: each group's window in tokens (0: full attention), full first, then ascending;
    layer_group: the group of each layer of the model."""

    windows: tuple[int, ...]
    layer_group: tuple[int, ...]

    @classmethod
    def of(cls, cfg) -> KVGroups:
        """The groups of a ModelConfig (hetero/config.py: layer_window says each layer's)."""
        per_layer = [cfg.layer_window(i) for i in range(cfg.n_layers)]
        windows = tuple(sorted(set(per_layer))) or (0,)
        return cls(windows, tuple(windows.index(w) for w in per_layer))

    @property
    def windowed(self) -> bool:
        return any(self.windows)

    def slots(self, layers: range) -> tuple[list[int], int]:
        """(pool slot of each layer of `layers`, slots a block needs): each layer's rank among
        the layers of its group in the range, and the largest group's count there."""
        seen = [0] * len(self.windows)
        out = []
        for i in layers:
            g = self.layer_group[i]
            out.append(seen[g])
            seen[g] += 1
        return out, max(seen, default=0)


def group_name(window: int, name: bytes) -> bytes:
    """The prefix-cache name of a group's block for the run of tokens named `name`
    (prefix_cache.block_hash). A full-attention block keeps the run's name (so a dense model's
    names, and its disk tier's files, are what they always were); a window group's block holds
    other layers' KV for the same tokens and gets a name of its own."""
    if not window:
        return name
    return hashlib.sha256(name + b"|window %d" % window).digest()


def first_needed(window: int, start: int, block_size: int, slack: int = 0) -> int:
    """The first block a group holds while positions from `start` on are computed: 0 for full
    attention; with a window, the block of position start - window + 1 (the first key the query
    at `start` sees), less `slack` positions a caller may roll back to (a draft model's
    rejected guesses)."""
    if not window:
        return 0
    return max(0, (start - window + 1 - slack) // block_size)


def blocks_needed(
    windows: tuple[int, ...], num_tokens: int, step_tokens: int, block_size: int, slack: int = 0
) -> int:
    """The most blocks of all groups one sequence of `num_tokens` holds at once when a step
    computes up to `step_tokens` positions (a long prompt's chunk): every block for full
    attention; a window group only those of the window before the block boundary the step
    starts in (block_manager._slide: ceil((w - 1 + slack) / B) blocks) and of the step, which
    starts at most B - 1 positions past that boundary."""
    total, full = 0, cdiv(num_tokens, block_size)
    for w in windows:
        held = cdiv(w - 1 + slack, block_size) + (block_size + step_tokens - 2) // block_size + 1
        total += full if not w else min(full, held)
    return total
