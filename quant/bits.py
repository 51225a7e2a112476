"""Byte-level helpers shared by the torch dequantizers.

Every dequantizer receives `blocks`: a uint8 tensor of shape (n_blocks, type_size), one GGUF block
per row, on any device. Fields are read straight from those bytes with integer ops; no numpy, so
the same code runs on CUDA. Multi-byte fields are little-endian, as GGUF stores them.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as float32 of shape (n_blocks, 1).

    The two bytes are copied out (2/type_size of the data) so the dtype view never depends on the
    alignment of the caller's storage offset; fp16 -> fp32 is exact, as in numpy.
    """
    raw = blocks[:, offset : offset + 2].clone(memory_format=torch.contiguous_format)
    return raw.view(torch.float16).to(torch.float32)


def low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, m) uint8 -> (n, k, 2, m): [..., 0, :] low nibbles, [..., 1, :] high nibbles.

    The common 4-bit layout: byte l of a group holds element l (low) and element l + m (high).
    """
    qs = qs.contiguous()  # strided byte slices send the broadcast ops down a slow path
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def crumbs(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, m) uint8 -> (n, k, 4, m): 2-bit fields at shifts 0, 2, 4, 6 (element s*m + l).

    The shifts are made on the device (arange), not copied from a host list: a host-to-device
    copy is not allowed while a CUDA graph captures, and Q6_K / Q3_K / Q2_K token embeddings
    dequantize through here inside the captured decode step.
    """
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=qs.device).view(4, 1)
    return (qs.contiguous().unsqueeze(-2) >> shifts) & 0x03


def bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """(n, m) uint8 -> (n, 8, m): plane b holds bit b of every byte (element b*m + l)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device).view(8, 1)
    return (bits.contiguous().unsqueeze(-2) >> shifts) & 0x01


def le_bits(bits: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 8k): bit i of the little-endian integer, i.e. bit i%8 of byte i//8."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.contiguous().unsqueeze(-1) >> shifts) & 0x01).reshape(bits.shape[0], -1)


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only, memory-mapped) numpy array, without a copy.

    GGUFReader hands out read-only memmaps; torch warns that writing through such a tensor is
    undefined. The quant paths only read, so the warning is silenced here rather than copying.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)
