"""Unquantized element types: F32, F16, BF16 (block size 1).

As blocks, each element is one "block" of `type_size` bytes, so the block API of the quantized
types covers them too: (n, type_size) uint8 -> (n, 1) float32. GGUFReader hands F32/F16 tensors
out typed (float32/float16 arrays) and BF16 as raw bytes; `registry.dequantize` takes the typed
ones by a direct path.

    BF16 (2 bytes, little-endian):  byte 1       byte 0
                                    SEEEEEEE     EMMMMMMM   = the top half of an IEEE float32
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants


def view_as(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret (n, k) uint8 rows as `dtype`, copying only when the storage forbids a view."""
    if blocks.is_contiguous() and blocks.storage_offset() % dtype.itemsize == 0:
        return blocks.view(dtype)
    return blocks.clone(memory_format=torch.contiguous_format).view(dtype)


def dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return view_as(blocks, torch.float32).clone()


def dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return view_as(blocks, torch.float16).to(torch.float32)


def dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # Same as gguf: sign-extend the 16 bits to int32 and shift them into the top half.
    bits = view_as(blocks, torch.int16).to(torch.int32) << 16
    return bits.view(torch.float32)


def quantize_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)


def quantize_f16(x: np.ndarray) -> np.ndarray:
    # numpy rounds to nearest even, overflowing to inf past 65504, as ggml's fp32 -> fp16 does.
    return np.ascontiguousarray(x, dtype=np.float16).view(np.uint8)


def quantize_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even (NaNs kept quiet), exactly gguf's and ggml's fp32 -> bf16."""
    out = quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType.BF16)
    return np.ascontiguousarray(out).view(np.uint8)
