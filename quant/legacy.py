"""The legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each dequantizer maps (n, type_size) uint8 blocks to (n, 32) float32 with the float operations of
`gguf.quants` in the same order (d * q, then + m), so results are equal bit for bit. Integer codes
are exact in any dtype, so only the float32 ops need to match.

Element j of a block is written x[j]; "d" and "m" are fp16 (2 bytes, little-endian).

    Q4_0 (18 B)  | d | qs[16] |                  x[j]    = d * ((qs[j] & 0xF) - 8)
                                                 x[j+16] = d * ((qs[j] >> 4)  - 8)
    Q4_1 (20 B)  | d | m | qs[16] |              x[j]    = d * (qs[j] & 0xF) + m      (j < 16)
    Q5_0 (22 B)  | d | qh u32 | qs[16] |         x[j]    = d * (q5[j] - 16)
    Q5_1 (24 B)  | d | m | qh u32 | qs[16] |     x[j]    = d * q5[j] + m
                 q5[j] = nibble j of qs (as in Q4) | (bit j of qh) << 4
    Q8_0 (34 B)  | d | qs[32] int8 |             x[j]    = d * qs[j]

The quantizers delegate to `gguf.quants.quantize`, which follows llama.cpp's reference rounding.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from .bits import f16_field, le_bits, low_high_nibbles


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) packed bytes -> (n, 32) uint8 codes: low nibbles are x[0:16], high ones x[16:32]."""
    return low_high_nibbles(qs.unsqueeze(1)).reshape(qs.shape[0], 32)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5 codes (n, 32) uint8 in 0..31 from qh (n, 4) and qs (n, 16)."""
    return _nibbles32(qs) | (le_bits(qh) << 4)


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = _nibbles32(blocks[:, 2:18]).to(torch.float32).sub_(8)
    return q.mul_(d)


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q = _nibbles32(blocks[:, 4:20]).to(torch.float32)
    return q.mul_(d).add_(m)


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:22]).to(torch.float32).sub_(16)
    return q.mul_(d)


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:24]).to(torch.float32)
    return q.mul_(d).add_(m)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    return blocks[:, 2:34].view(torch.int8).to(torch.float32).mul_(d)


def gguf_quantizer(ggml_type: GGMLQuantizationType):
    """A (..., n) float32 -> (..., n/32*type_size) uint8 quantizer backed by gguf's numpy code."""

    def quantize(x: np.ndarray) -> np.ndarray:
        return np.asarray(quants.quantize(np.asarray(x, dtype=np.float32), ggml_type))

    quantize.__name__ = f"quantize_{ggml_type.name.lower()}"
    return quantize
