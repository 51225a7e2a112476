"""The RAM tier's one host buffer, as large as can be had: memory that cannot be had shrinks the
tier (with a warning), it never stops the engine.

Pinned memory is limited (containers, `ulimit -l`, a host short of RAM) and pinning can be
impossible (no accelerator driver). Asked for R blocks, the buffer is, in order of preference:

    pinned R, R/2, ... R/16 blocks      (restores copy at full PCIe rate)
    pageable R, R/2, ... 1 block        (restores stage through a pinned bounce: slower)
    none (the RAM tier is off; the disk tier, if any, takes the evicted blocks directly)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("hetero.kv_tiers")

PIN_SHRINK = 16  # pinned memory is tried down to 1/16 of the ask before pageable memory


@dataclass
class HostBuffer:
    buf: torch.Tensor | None
    slots: int
    pinned: bool


def _try(nbytes: int, pin: bool) -> tuple[torch.Tensor | None, BaseException | None]:
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), None
    except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError
        return None, e


def allocate(block_bytes: int, slots: int, pin: bool) -> HostBuffer:
    """A buffer of up to `slots` blocks of `block_bytes`, pinned when `pin` and possible."""
    if slots <= 0:
        return HostBuffer(None, 0, False)
    tries = []
    if pin:
        floor = max(1, slots // PIN_SHRINK)
        n = slots
        while n >= floor:
            tries.append((n, True))
            n //= 2
    n = slots
    while n >= 1:
        tries.append((n, False))
        n //= 2
    first_error = None
    for n, pinned in tries:
        buf, err = _try(n * block_bytes, pinned)
        if buf is not None:
            if n < slots or pinned != pin:
                _warn(slots, n, pinned, block_bytes, first_error)
            return HostBuffer(buf, n, pinned)
        first_error = first_error or err
    log.warning(
        "RAM tier: no host memory for even one KV block (%s); the RAM tier is off",
        _short(first_error),
    )
    return HostBuffer(None, 0, False)


def _warn(asked: int, got: int, pinned: bool, block_bytes: int, err) -> None:
    kind = "pinned" if pinned else "pageable (slower restores)"
    log.warning(
        "RAM tier: %d blocks (%.2f GiB) of host memory cannot be had as asked (%s); using %d "
        "blocks (%.2f GiB) of %s memory",
        asked,
        asked * block_bytes / 2**30,
        _short(err),
        got,
        got * block_bytes / 2**30,
        kind,
    )


def _short(err: BaseException | None) -> str:
    text = str(err).strip().splitlines()[0] if err is not None else "unknown error"
    return text[:200]
