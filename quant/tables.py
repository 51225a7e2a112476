"""Lookup tables (codebooks, IQ grids) kept once per device.

The dequantizers index small constant tensors by the codes of a block. Those tensors must live
on the codes' device; a host-to-device copy is not allowed while a CUDA graph captures, so each
table is copied once per device and reused (the engine runs every step eagerly once before it
captures, which fills this cache).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

_CACHE: dict[tuple[Hashable, torch.device], torch.Tensor] = {}
_LOCK = threading.Lock()


def _canonical(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(
    key: Hashable, device: torch.device | str, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The table `key` on `device`, made by `build()` (on the CPU) the first time."""
    device = _canonical(device)
    table = _CACHE.get((key, device))
    if table is None:
        with _LOCK:
            table = _CACHE.get((key, device))
            if table is None:
                table = build().to(device)
                _CACHE[(key, device)] = table
    return table
