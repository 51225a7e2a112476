"""Torch dequantizers for the grid i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

256-element super-blocks whose codes index a grid of 8- or 4-value points (`iq_grids`), with
signs (+-1) and a scale per 16 or 32 elements. Every product is exact in float32 (the grid
values and scales have few significant bits), so results equal `gguf.quants` bit for bit; the
operations still follow its order. A super-block's element e is x[e]; "d" is an fp16 (little-
endian); u16 and u32 fields are little-endian too. Group g covers x[32g : 32g + 32].

IQ2_XXS (66 B)  | d | 8 x (u32 grid, u32 aux) |
    grid: 4 bytes, each a point of 8 (256-point grid); aux: 4 x 7-bit ksigns indices, scale in
    bits 28..31:  x = (d * (0.5 + s) * 0.25) * grid * sign
IQ2_XS (74 B)   | d | qs u16[32] | scales[8] |
    qs: grid index (bits 0..8, 512 points) | ksigns index << 9; a 4-bit scale per 16 elements
    (nibble k of scales[j] is scale 2j + k):  x = (d * (0.5 + s) * 0.25) * grid * sign
IQ2_S (82 B)    | d | qs[32] | signs[32] | qh[8] | scales[8] |
    grid index qs[i] | ((qh[i // 4] >> 2 (i % 4)) & 3) << 8 (1024 points); sign bits stored
    plainly (bit b of signs[i]: element 8i + b); scales as IQ2_XS
IQ3_XXS (98 B)  | d | qs[64] | 8 x u32 aux |
    qs: points of 4 (256-point grid); aux as IQ2_XXS's:  x = (d * (0.5 + s) * 0.5) * grid * sign
IQ3_S (110 B)   | d | qs[64] | qh[8] | signs[32] | scales[4] |
    grid index qs[i] | (bit i % 8 of qh[i // 8]) << 8 (512 points of 4); plain sign bits;
    4-bit scale per group (nibble k of scales[j] is group 2j + k):  x = (d * (1 + 2s)) * grid * sign
IQ1_S (50 B)    | d | qs[32] | qh u16[8] |
    group g: point k's index qs[4g + k] | ((qh[g] >> 3k) & 7) << 8 (2048 points of -1/0/1),
    scale (qh[g] >> 12) & 7, delta -0.125 if bit 15 else 0.125:  x = (d * (2s + 1)) * (grid + delta)
IQ1_M (56 B)    | qs[32] | qh[16] | scales u16[4] |
    d: fp16 whose 4-bit pieces are the top nibbles of the scales words (word k: bits 4k .. 4k+3)
    3-bit scale per 16 elements (word k, bits 3j .. 3j+2: scale 4k + j); point i's index
    qs[i] | (nibble i % 2 of qh[i // 2] & 7) << 8, and its delta from that nibble's bit 3
"""

from __future__ import annotations

import torch

from .bits import f16_field, low_high_nibbles
from .iq_grids import bit_signs, grid, ksigns

QK_K = 256
IQ1_DELTA = 0.125


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4k) little-endian bytes -> (..., k) int64."""
    b = b.reshape(*b.shape[:-1], -1, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2k) little-endian bytes -> (..., k) int64."""
    b = b.reshape(*b.shape[:-1], -1, 2).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8)


def _shifted(v: torch.Tensor, step: int, count: int) -> torch.Tensor:
    """v (...) int64 -> (..., count): v >> 0, v >> step, ... (shifts made on v's device)."""
    shifts = torch.arange(0, step * count, step, dtype=torch.int64, device=v.device)
    return v.unsqueeze(-1) >> shifts


def _aux_signs(aux: torch.Tensor) -> torch.Tensor:
    """(n, 8) u32 aux words -> (n, 8, 4, 8) signs from their four 7-bit ksigns indices."""
    return ksigns(aux.device)[_shifted(aux, 7, 4) & 127]


def _nibble_scales(scales: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) float32 4-bit scales (low nibble first)."""
    n = scales.shape[0]
    return low_high_nibbles(scales.unsqueeze(-1)).reshape(n, -1).to(torch.float32)


def dequant_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    q = blocks[:, 2:66].reshape(n, 8, 8)
    aux = _u32(q[:, :, 4:8]).reshape(n, 8)
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.25).view(n, 8, 1, 1)
    points = grid("IQ2_XXS", blocks.device)[q[:, :, 0:4].long()]  # (n, 8, 4, 8)
    return (db * points * _aux_signs(aux)).view(n, QK_K)


def dequant_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = _u16(blocks[:, 2:66])  # (n, 32)
    db = (d * (0.5 + _nibble_scales(blocks[:, 66:74])) * 0.25).view(n, 16, 1, 1)
    signs = ksigns(blocks.device)[qs >> 9].view(n, 16, 2, 8)
    points = grid("IQ2_XS", blocks.device)[qs & 511].view(n, 16, 2, 8)
    return (db * points * signs).view(n, QK_K)


def _high_bit_points(
    name: str, qs: torch.Tensor, qh: torch.Tensor, signs: torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_S / IQ3_S: grid points indexed by qs[i] | (the i-th field of qh's bytes) << 8, and
    their plainly stored sign bits, both as `shape`. qh holds 8 bits per byte for len(qs)/8
    (one bit a point) or 4 fields of 2 bits for len(qs)/4 (two)."""
    n = qs.shape[0]
    bits = 8 * qh.shape[1] // qs.shape[1]
    high = _shifted(qh.to(torch.int64), bits, 8 // bits).reshape(n, -1) & ((1 << bits) - 1)
    points = grid(name, qs.device)[qs.to(torch.int64) | (high << 8)].view(shape)
    return points, bit_signs(signs).view(shape)


def dequant_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    db = (d * (0.5 + _nibble_scales(blocks[:, 74:82])) * 0.25).view(n, 16, 1, 1)
    shape = (n, 16, 2, 8)
    points, signs = _high_bit_points(
        "IQ2_S", blocks[:, 2:34], blocks[:, 66:74], blocks[:, 34:66], shape
    )
    return (db * points * signs).view(n, QK_K)


def dequant_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    aux = _u32(blocks[:, 66:98])  # (n, 8)
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).view(n, 8, 1, 1)
    points = grid("IQ3_XXS", blocks.device)[blocks[:, 2:66].long()].view(n, 8, 4, 8)
    return (db * points * _aux_signs(aux)).view(n, QK_K)


def dequant_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    db = (d * (1 + 2 * _nibble_scales(blocks[:, 106:110]))).view(n, 8, 1, 1)
    shape = (n, 8, 4, 8)
    points, signs = _high_bit_points(
        "IQ3_S", blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106], shape
    )
    return (db * points * signs).view(n, QK_K)


def _iq1_delta(flag: torch.Tensor) -> torch.Tensor:
    """+-IQ1_DELTA: the negative one where `flag` is set."""
    return torch.where(flag != 0, -IQ1_DELTA, IQ1_DELTA).to(torch.float32)


def dequant_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = _u16(blocks[:, 34:50])  # (n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).view(n, 8, 1, 1)
    delta = _iq1_delta(qh & 0x8000).view(n, 8, 1, 1)
    index = blocks[:, 2:34].to(torch.int64).view(n, 8, 4) | ((_shifted(qh, 3, 4) & 7) << 8)
    points = grid("IQ1_S", blocks.device)[index]  # (n, 8, 4, 8)
    return (dl * (points + delta)).view(n, QK_K)


def iq1_m_scale(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 56) blocks -> (n, 1) float32 d, assembled from the scale words' top nibbles."""
    words = _u16(blocks[:, 48:56])  # (n, 4)
    bits = (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0x00F0)
    bits = bits | ((words[:, 2] >> 4) & 0x0F00) | (words[:, 3] & 0xF000)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # as int16, the same 16 bits
    return bits.to(torch.int16).view(torch.float16).to(torch.float32).view(-1, 1)


def dequant_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = iq1_m_scale(blocks)
    scales = _shifted(_u16(blocks[:, 48:56]), 3, 4).reshape(n, 16) & 7
    dl = (d * (2 * scales + 1).to(torch.float32)).view(n, 8, 2, 1, 1)
    nibbles = low_high_nibbles(blocks[:, 32:48].unsqueeze(-1)).reshape(n, 32).to(torch.int64)
    index = blocks[:, 0:32].to(torch.int64) | ((nibbles & 7) << 8)
    delta = _iq1_delta(nibbles & 8).view(n, 8, 2, 2, 1)
    points = grid("IQ1_M", blocks.device)[index].view(n, 8, 2, 2, 8)
    return (dl * (points + delta)).view(n, QK_K)
