"""The IQ grids and sign tables as torch tensors, one copy per device.

grid(name, device)   float32 [points, 8 or 4]: the values of each grid point (the byte values
                     of llama.cpp's iq*_grid tables: 8/25/43 for IQ2, odd 4..62 or 1..15 for
                     IQ3, -1/0/1 for IQ1)
ksigns(device)       float32 [128, 8] of +-1: llama.cpp's ksigns_iq2xs, 7 stored sign bits
                     and an eighth that makes the count of minus signs even
bit_signs(bits)      uint8 (...) -> float32 (..., 8) of +-1: -1 where bit i is set
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import iq_grid_data
from .iq_grid_data import GridData
from .tables import on_device

GRIDS: dict[str, GridData] = {
    "IQ1_S": iq_grid_data.IQ1S,
    "IQ1_M": iq_grid_data.IQ1S,  # IQ1_M points into IQ1_S's grid
    "IQ2_XXS": iq_grid_data.IQ2XXS,
    "IQ2_XS": iq_grid_data.IQ2XS,
    "IQ2_S": iq_grid_data.IQ2S,
    "IQ3_XXS": iq_grid_data.IQ3XXS,
    "IQ3_S": iq_grid_data.IQ3S,
}


def decode(data: GridData) -> torch.Tensor:
    """The packed hex text -> float32 [points, values a point] (iq_grid_data's docstring)."""
    packed = np.frombuffer(bytes.fromhex(data.hex), dtype=np.uint8)
    bits = math.ceil(math.log2(len(data.values)))
    per_byte = 8 // bits
    shifts = np.arange(0, 8, 8 // per_byte, dtype=np.uint8)
    index = (packed[:, None] >> shifts) & ((1 << bits) - 1)
    values = np.asarray(data.values, dtype=np.float32)[index.reshape(data.shape)]
    return torch.from_numpy(values)


def grid(name: str, device: torch.device) -> torch.Tensor:
    return on_device(("iq grid", name), device, lambda: decode(GRIDS[name]))


def ksigns_table() -> np.ndarray:
    """uint8 [128]: i with bit 7 set where i has an odd number of set bits."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return i | (parity.astype(np.uint8) << 7)


def _sign_values(bits: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    set_ = (bits.unsqueeze(-1) >> shifts) & 1
    return 1.0 - 2.0 * set_.to(torch.float32)


def ksigns(device: torch.device) -> torch.Tensor:
    return on_device("iq ksigns", device, lambda: _sign_values(torch.from_numpy(ksigns_table())))


def bit_signs(bits: torch.Tensor) -> torch.Tensor:
    """uint8 (...) -> float32 (..., 8): element i is -1 where bit i of the byte is set, else 1."""
    return _sign_values(bits.contiguous())
