"""What the qdot kernel computes, in torch: exact integer block dots, float scales once a block.

Independent of the C code: each GGUF block is split here, from its bytes (the field layouts of
quant/kquants.py, quant/legacy.py and quant/codebooks.py), into integer codes u, integer scales
and offsets, and float scales, such that the dequantized weight is

    legacy (32 a block):  w = d * (u + off) + m          (Q4_0: off -8; Q5_0: -16; Q4_1/Q5_1: m)
    K-quants (256):       w = dk * sc_s * u + dm * M_j   (s: the weight's sub-block of 32 or 16,
                                                          j: its 16-block; Q4_K: M = -min,
                                                          Q6_K: dm = dk, M = -32 sc, ...)

The codes are unsigned, but for Q8_0's int8 and the codebook types', whose u is the table's int8
value of each 4-bit code: IQ4_NL and MXFP4 are legacy blocks (off 0, m 0; MXFP4's d is its
exponent byte's 2^(e - 128)), IQ4_XS a K-quant one (sc_s = ls_s - 32 per 32, M 0).

and with activations x ~ xd * xq (`quantize_x_reference`, the native quantizer's twin):

    y[t, n] = sum_b xd[t,b] * (d * (u . xq + off * sum xq) + m * sum xq)                legacy
    y[t, n] = sum_b xd[t,b] * (dk * sum_s sc_s (u . xq)_s + dm * sum_j M_j bsum_j)     K-quants

The integer sums are exact (float64 holds them), so the kernel must agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from hetero.quant.bits import bit_planes, crumbs, f16_field, le_bits, low_high_nibbles
from hetero.quant.codebooks import E2M1_DOUBLED, IQ4NL_VALUES, e8m0_half, iq4_xs_scales
from hetero.quant.kquants import k4_scale_min, q3_k_scales

_T = GGMLQuantizationType


@dataclass
class Split:
    """One weight [n, k] as integer codes and scales; b: blocks along k."""

    u: torch.Tensor  # int64 [n, b, block]
    sc: torch.Tensor  # int64 [n, b, nsub] (legacy: ones, nsub 1)
    off: torch.Tensor  # int64 [n, b, 16 or 2]: M_j per 16 weights (legacy: off per 16)
    d: torch.Tensor  # float64 [n, b]: dk (legacy d)
    dm: torch.Tensor  # float64 [n, b]: dm (legacy: d as well, multiplying off)
    m: torch.Tensor  # float64 [n, b]: legacy m (0 for K-quants)

    def weights(self) -> torch.Tensor:
        """float64 [n, k]: the weights the parts stand for."""
        n, b, qb = self.u.shape
        sub = qb // self.sc.shape[2]
        w = self.d[..., None] * (self.u * self.sc.repeat_interleave(sub, dim=2))
        w = w + self.dm[..., None] * self.off.repeat_interleave(16, dim=2) + self.m[..., None]
        return w.reshape(n, b * qb)


def _codebook(qs: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    """(nb, 16 g) bytes of nibble codes -> (nb, 32 g) int64: the table's value of each, in
    element order (each 16 bytes: 32 codes, low nibbles first)."""
    codes = low_high_nibbles(qs.reshape(qs.shape[0], -1, 16)).reshape(qs.shape[0], -1)
    return torch.tensor(values, dtype=torch.long)[codes.long()]


def _legacy(blocks: torch.Tensor, t: GGMLQuantizationType):
    def nib(start: int) -> torch.Tensor:
        return low_high_nibbles(blocks[:, start : start + 16].unsqueeze(1)).reshape(-1, 32)

    if t == _T.MXFP4:
        d = e8m0_half(blocks[:, 0:1])[:, 0]
        return _codebook(blocks[:, 1:17], E2M1_DOUBLED), d, torch.zeros_like(d), 0
    d = f16_field(blocks, 0)[:, 0]
    zero = torch.zeros_like(d)
    if t == _T.Q8_0:
        return blocks[:, 2:34].view(torch.int8), d, zero, 0
    if t == _T.IQ4_NL:
        return _codebook(blocks[:, 2:18], IQ4NL_VALUES), d, zero, 0
    if t in (_T.Q4_0, _T.Q4_1):
        u = nib(2 if t == _T.Q4_0 else 4)
        return (u, d, zero, -8) if t == _T.Q4_0 else (u, d, f16_field(blocks, 2)[:, 0], 0)
    start = 2 if t == _T.Q5_0 else 4
    u = nib(start + 4) | (le_bits(blocks[:, start : start + 4]) << 4)
    return (u, d, zero, -16) if t == _T.Q5_0 else (u, d, f16_field(blocks, 2)[:, 0], 0)


def _kquant(blocks: torch.Tensor, t: GGMLQuantizationType):
    """-> u [nb, 256], sc [nb, nsub], M [nb, 16], dk, dm (all per block)."""
    nb = blocks.shape[0]
    if t == _T.IQ4_XS:
        d = f16_field(blocks, 0)[:, 0]
        u, sc = _codebook(blocks[:, 8:136], IQ4NL_VALUES), iq4_xs_scales(blocks).long()
        return u, sc, torch.zeros(nb, 16, dtype=torch.long), d, d
    if t in (_T.Q4_K, _T.Q5_K):
        sc, mn = k4_scale_min(blocks[:, 4:16])
        start = 16 if t == _T.Q4_K else 48
        u = low_high_nibbles(blocks[:, start : start + 128].reshape(nb, 4, 32)).reshape(nb, 256)
        if t == _T.Q5_K:
            u = u | (bit_planes(blocks[:, 16:48]).reshape(nb, 256) << 4)
        off = -mn.long().repeat_interleave(2, dim=1)
        return u, sc, off, f16_field(blocks, 0)[:, 0], f16_field(blocks, 2)[:, 0]
    if t == _T.Q6_K:
        low = low_high_nibbles(blocks[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
        u = (low | (crumbs(blocks[:, 128:192].reshape(nb, 2, 32)) << 4)).reshape(nb, 256)
        sc = blocks[:, 192:208].view(torch.int8).long()
        d = f16_field(blocks, 208)[:, 0]
        return u, sc, -32 * sc, d, d
    qs = blocks[:, 32:96] if t == _T.Q3_K else blocks[:, 16:80]
    low = crumbs(qs.reshape(nb, 2, 32)).reshape(nb, 256)
    if t == _T.Q3_K:
        u = low | (bit_planes(blocks[:, 0:32]).reshape(nb, 256) << 2)
        sc = q3_k_scales(blocks[:, 96:108]).long()
        d = f16_field(blocks, 108)[:, 0]
        return u, sc, -4 * sc, d, d
    scales = blocks[:, 0:16]  # Q2_K
    off = -(scales >> 4).long()
    return low, scales & 15, off, f16_field(blocks, 80)[:, 0], f16_field(blocks, 82)[:, 0]


def split(raw: torch.Tensor, ggml_type, n: int, k: int) -> Split:
    """GGUF bytes of W [n, k] -> its integer parts (the module docstring's formulas)."""
    t = _T(int(ggml_type))
    from hetero.quant import get_quant

    qt = get_quant(t)
    blocks = raw.reshape(-1, qt.type_size)
    b = k // qt.block_size
    if qt.block_size == 32:
        u, d, m, off = _legacy(blocks, t)
        ones = torch.ones(n, b, 1, dtype=torch.long)
        offs = torch.full((n, b, 2), off, dtype=torch.long)
        f64 = [v.double().reshape(n, b) for v in (d, d, m)]
        return Split(u.long().reshape(n, b, 32), ones, offs, *f64)
    u, sc, off, dk, dm = _kquant(blocks, t)
    zeros = torch.zeros(n, b, dtype=torch.float64)
    parts = (u.long().reshape(n, b, 256), sc.long().reshape(n, b, -1), off.reshape(n, b, 16))
    return Split(*parts, dk.double().reshape(n, b), dm.double().reshape(n, b), zeros)


def quantize_x_reference(x: torch.Tensor, qb: int):
    """The torch twin of the native quantizer: xq int8 [T, K], xd [T, K/qb], bs int16 [T, K/16]
    (the same float32 operations: bit-identical)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // qb, qb)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(t, k)
    bs = q.reshape(t, k // 16, 16).sum(dim=2, dtype=torch.int16)
    return q, d, bs


def qdot_reference(x: torch.Tensor, raw: torch.Tensor, ggml_type, n: int, k: int) -> torch.Tensor:
    """y [T, n] float32 = what the qdot kernel computes for x [T, k] and GGUF bytes of W [n, k]."""
    return reference_terms(x, raw, ggml_type, n, k)[0].float()


def reference_terms(x: torch.Tensor, raw: torch.Tensor, ggml_type, n: int, k: int):
    """(y, size) float64 [T, n]: the reference and the sum of its per-block terms' magnitudes,
    which bounds the rounding of any float32 order of summing them (|error| <~ size * 1e-6)."""
    s = split(raw, ggml_type, n, k)
    nb, qb = s.u.shape[1], s.u.shape[2]
    xq, xd, bs = quantize_x_reference(x, qb)
    nsub = s.sc.shape[2]
    y8 = xq.double().reshape(-1, nb, nsub, qb // nsub)
    dots = torch.einsum("tbsj,nbsj->tnbs", y8, s.u.double().reshape(n, nb, nsub, qb // nsub))
    i1 = (dots * s.sc.double()[None]).sum(-1)  # exact integers [T, n, b]
    sums = bs.double().reshape(-1, nb, qb // 16)  # [T, b, qb/16]
    i2 = torch.einsum("tbj,nbj->tnb", sums, s.off.double())
    ysum = sums.sum(-1)[:, None]  # [T, 1, b]
    terms = (s.d[None] * i1, s.dm[None] * i2, s.m[None] * ysum)
    xd = xd.double()[:, None, :]
    y = (xd * sum(terms)).sum(-1)
    size = sum((xd * v).abs() for v in terms).sum(-1)
    return y, size
