"""Torch dequantizers for the K-quants: 256-element super-blocks (QK_K = 256).

Each maps (n, type_size) uint8 to (n, 256) float32 with `gguf.quants`' float32 operations in the
same order: first the sub-block scale (d * sc, dmin * m), then scale * q (- min), so results are
equal bit for bit. "d"/"dmin" are little-endian fp16. Element e of a super-block is x[e].

Q2_K (84 B): 16 sub-blocks of 16
    | scales[16] | qs[64] | d | dmin |
    scales[s] = m_s << 4 | sc_s            x[e] = (d * sc_s) * q[e] - (dmin * m_s),  s = e // 16
    q[e] = (qs[32*h + l] >> 2*k) & 3       for e = 128*h + 32*k + l   (h < 2, k < 4, l < 32)

Q3_K (110 B): 16 sub-blocks of 16, signed 6-bit scales
    | hmask[32] | qs[64] | scales[12] | d |
    q[e] = (2 low bits as in Q2_K) - (0 if bit (e // 32) of hmask[e % 32] else 4)     in -4..3
    scales, 12 bytes -> 16 values of 6 bits (sc_s - 32; capitals = low nibble, lower = top bits):
      bytes 0..7:  (sc_{s+8} low4) << 4 | (sc_s low4)                 s < 8
      bytes 8..11: sc_{j+12}>>4 << 6 | sc_{j+8}>>4 << 4 | sc_{j+4}>>4 << 2 | sc_j>>4     j < 4
    x[e] = (d * (sc_s - 32)) * q[e]

Q4_K (144 B): 8 sub-blocks of 32, 6-bit scales and mins
    | d | dmin | scales[12] | qs[128] |
      scales bytes 0..3: sc_j (low 6) | (sc_{j+4} >> 4) << 6      j < 4
      bytes 4..7:        m_j  (low 6) | (m_{j+4}  >> 4) << 6
      bytes 8..11:       (m_{j+4} & 0xF) << 4 | (sc_{j+4} & 0xF)
    q[e] = nibble k of qs[32*c + l]  for e = 64*c + 32*k + l   (c < 4, k < 2: low, high)
    x[e] = (d * sc_s) * q[e] - (dmin * m_s),  s = e // 32

Q5_K (176 B): Q4_K plus a fifth bit
    | d | dmin | scales[12] | qh[32] | qs[128] |
    q[e] = (Q4_K nibble) | (bit (e // 32) of qh[e % 32]) << 4          in 0..31

Q6_K (210 B): 16 sub-blocks of 16, int8 scales
    | ql[128] | qh[64] | scales[16] int8 | d |
    for e = 128*h + 32*k + l  (h < 2, k < 4, l < 32):
      low 4 bits  = nibble (k // 2) of ql[64*h + 32*(k % 2) + l]
      high 2 bits = (qh[32*h + l] >> 2*k) & 3
    x[e] = (d * scales[e // 16]) * (q[e] - 32)
"""

from __future__ import annotations

import torch

from .bits import bit_planes, crumbs, f16_field, low_high_nibbles

QK_K = 256


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    # (n, 2, 32) -> (n, 2, 4, 32) -> 16 sub-blocks of 16 in element order
    q = crumbs(blocks[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """(n, 12) packed bytes -> (n, 16) int8 scale codes (already minus 32)."""
    n = scales.shape[0]
    low = low_high_nibbles(scales[:, 0:8].unsqueeze(1)).reshape(n, 16)  # sc_0..7, sc_8..15
    high = crumbs(scales[:, 8:12].unsqueeze(1)).reshape(n, 16)  # shift 2k of byte j -> sc_{4k+j}
    return (low | (high << 4)).to(torch.int8) - 32


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 108)
    dl = (d * q3_k_scales(blocks[:, 96:108]).to(torch.float32)).view(n, 16, 1)
    low = crumbs(blocks[:, 32:96].reshape(n, 2, 32)).reshape(n, 16, 16)
    high = bit_planes(blocks[:, 0:32]).reshape(n, 16, 16)  # plane b covers x[32b : 32b+32]
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return q.to(torch.float32).mul_(dl).view(n, QK_K)


def k4_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 12) packed bytes -> 6-bit (sc, m), each (n, 8) uint8, for Q4_K and Q5_K."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _k4_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (d * sc, dmin * m), each (n, 8, 1) float32."""
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = k4_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(n, 8, 1)
    return dl, ml


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    dl, ml = _k4_scales(blocks)
    q = low_high_nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    return q.to(torch.float32).mul_(dl).sub_(ml).view(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    dl, ml = _k4_scales(blocks)
    low = low_high_nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = bit_planes(blocks[:, 16:48])  # (n, 8, 32): plane s is the fifth bit of sub-block s
    q = low | (high << 4)
    return q.to(torch.float32).mul_(dl).sub_(ml).view(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 208)
    dl = (d * blocks[:, 192:208].view(torch.int8).to(torch.float32)).view(n, 16, 1)
    # ql (n, 2, 64) -> (n, 2, 2, 64): [h, nibble k//2, 32*(k%2) + l] is element 128h + 32k + l
    low = low_high_nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = crumbs(blocks[:, 128:192].reshape(n, 2, 32))  # (n, 2, 4, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return q.view(n, 16, 16).to(torch.float32).mul_(dl).view(n, QK_K)
