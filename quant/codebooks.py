"""Torch dequantizers for the 4-bit codebook formats: MXFP4, IQ4_NL, IQ4_XS.

A 4-bit code q does not scale linearly here: it indexes a 16-entry table of int8 values, and the
weight is scale * table[q]. Every product is exact in float32 (at most 11 + 6 + 7 significant
bits), so the order of the multiplications cannot change a bit; they still follow
`gguf.quants`' order. Element e of a block is x[e]; codes are nibbles, byte j of a 32-element
group holding x[j] (low nibble) and x[j + 16] (high nibble), as in Q4_0.

MXFP4 (17 B, 32 weights; OCP microscaling FP4, gpt-oss's expert format)
    | e u8 | qs[16] |             x[j] = d * E2M1[q],  d = 2^(e - 128)  ("e8m0 half":
                                   E2M1 values are stored doubled, so the scale is halved)
    d as float32 bits: e >= 2: (e - 1) << 23 (a normal power of two);
                       e < 2:  0x00200000 << e (the subnormals 2^-128, 2^-127)

IQ4_NL (18 B, 32 weights)
    | d f16 | qs[16] |            x[j] = d * IQ4NL[q]

IQ4_XS (136 B, 256 weights: 8 groups of 32 with 6-bit scales)
    | d f16 | scales_h u16 | scales_l[4] | qs[128] |
    ls_g = (nibble g % 2 of scales_l[g // 2]) | ((scales_h >> 2g) & 3) << 4      g < 8
    x[32g + j] = (d * (ls_g - 32)) * IQ4NL[q],  q from qs[16g : 16g + 16]

The tables are llama.cpp's kvalues_mxfp4 and kvalues_iq4nl (ggml-common.h), as gguf-py's
quants.py spells them.
"""

from __future__ import annotations

import torch

from .bits import f16_field, low_high_nibbles
from .tables import on_device

# E2M1 (sign, 2-bit exponent, 1-bit mantissa) doubled: 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
QK_K = 256


def codebook(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A 16-entry table as float32 on `device` (cached: see `tables.on_device`)."""
    return on_device(values, device, lambda: torch.tensor(values, dtype=torch.float32))


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """(n, g*16) bytes -> (n, g*32) int64 codes in element order (each 16 bytes: 32 codes)."""
    n = qs.shape[0]
    return low_high_nibbles(qs.reshape(n, -1, 16)).reshape(n, -1).long()


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> float32 2^(e - 128), bit for bit as ggml_e8m0_to_fp32_half."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(blocks[:, 0:1])
    q = codebook(E2M1_DOUBLED, blocks.device)[_nibble_codes(blocks[:, 1:17])]
    return d * q


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = codebook(IQ4NL_VALUES, blocks.device)[_nibble_codes(blocks[:, 2:18])]
    return d * q


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 136) blocks -> (n, 8) int32 group scales ls - 32, in -32..31."""
    low = low_high_nibbles(blocks[:, 4:8].unsqueeze(1))  # (n, 1, 2, 4): [k, j] is group 2j + k
    low = low.transpose(-1, -2).reshape(-1, 8).to(torch.int32)
    h = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device)
    high = (h.unsqueeze(1) >> shifts) & 3
    return (low | (high << 4)) - 32


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    dl = (d * iq4_xs_scales(blocks).to(torch.float32)).view(n, 8, 1)
    q = codebook(IQ4NL_VALUES, blocks.device)[_nibble_codes(blocks[:, 8:136])]
    return (dl * q.view(n, 8, 32)).view(n, QK_K)
