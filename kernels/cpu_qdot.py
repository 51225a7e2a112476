"""The "qdot" CPU linear: GGUF block weights times int8-quantized activations, in native code.

llama.cpp's CPU path: weights stay in 32-weight blocks (0.56-1.06 bytes per weight instead of
fp16's 2), each 32-block of x is rounded to int8 with a float32 scale, and blocks multiply as
integers (kernels/cpu_qdot.c: AVX2 maddubs/madd, a plain C loop elsewhere), built at first use
(kernels/native.py); where no compiler builds it, `available()` is False and the CPU linears
stay fp16.

    kind  GGUF types          qs                           d (and m), float32       bytes/w
    q4    Q4_0, Q4_1          uint8 [N/8, K/32, 128]       [N/8, K/32, 8]: w = d*q + m  0.75
    q8    Q8_0                int8 [N, K/32, 32]           [N, K/32]: w = d*q           1.125
    q8    others (requant)    int8 [N, K/32, 32]           d = amax/127 per block

Q4 rows are interleaved in groups of 8 (N padded with zero rows; the byte order is drawn in
kernels/cpu_qdot.c): one AVX2 maddubs then serves 8 rows, and their int16 sums need one madd.

Q4_0/Q4_1/Q8_0 keep their codes and scales (fp16 -> fp32, exact): the kernel multiplies by the
exact dequantized weights, and its only rounding is the int8 activations' (x ~ xd * xq per block,
|error| <= xd/2). `qdot_reference` does the same integer arithmetic in torch (float64 sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hetero.kernels import native
from hetero.quant import QuantType, dequantize
from hetero.quant.bits import f16_field

_T = GGMLQuantizationType
QK = 32
GROUP = 8  # Q4 rows interleaved per group
NATIVE_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q8_0)
# Types that run requantized to Q8 blocks: their requantization stays within the loader's error
# budget (cpu_linear.DEFAULT_MAX_ERROR, 4e-3 relative RMS) on random blocks: Q2_K 3.86e-3, Q4_K
# 3.64e-3, Q5_0 3.80e-3, Q5_1 3.89e-3, Q5_K 3.69e-3. Q3_K (4.59e-3) and Q6_K (4.46e-3), whose
# 32 weights carry two scales, do not: they and the float types run fp16 in "qdot" mode, so the
# planner (planner/model_desc.py) prices a layer as the loader packs it without reading weights.
REQUANT_TYPES = (_T.Q2_K, _T.Q4_K, _T.Q5_0, _T.Q5_1, _T.Q5_K)


def cpu_scheme(ggml_type) -> str:
    """The packing "qdot" mode gives a tensor of `ggml_type` (a type or its name): "qdot" (its
    own or requantized Q8 blocks; a requantized one still falls back to fp16 where the loader
    measures it past the error budget) or "fp16"."""
    qdot = {t.name for t in NATIVE_TYPES + REQUANT_TYPES}
    return "qdot" if _type_name(ggml_type) in qdot else "fp16"


def qdot_blocks(ggml_type) -> str:
    """The GGUF block type a tensor of `ggml_type` runs as in "qdot" packing: its own (Q4_0, Q4_1,
    Q8_0), or Q8_0 for the types requantized to it."""
    name = _type_name(ggml_type)
    return name if name in {t.name for t in NATIVE_TYPES} else "Q8_0"


def _type_name(ggml_type) -> str:
    """A GGUF type's name, from the type, its number or the name (any type, supported or not)."""
    return ggml_type if isinstance(ggml_type, str) else _T(int(ggml_type)).name


def load():
    return native.load()


def available() -> bool:
    return native.available()


@dataclass(eq=False)
class QdotWeight:
    """W [n, k] in the kernel's layout (k: whole 32-blocks; the module docstring's table)."""

    is_q4: bool
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row layout: codes [n, K/32, 32] (uint8 0..15 or int8), d and m [n, K/32]."""
        nb = self.k // QK
        if not self.is_q4:
            return self.qs, self.d, None
        g = self.qs.reshape(-1, nb, 4, GROUP, 4)  # [G, b, c, r, i]
        nib = torch.cat((g & 15, g >> 4), dim=2)  # [G, b, 8 (lo c, then hi c), r, i]
        codes = nib.permute(0, 3, 1, 2, 4).reshape(-1, nb, QK)[: self.n]

        def per_row(v: torch.Tensor) -> torch.Tensor:
            return v.permute(0, 2, 1).reshape(-1, nb)[: self.n]

        return codes, per_row(self.d), per_row(self.m)


def _interleave(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-major Q4 qs [n, nb, 16], d, m [n, nb] -> groups of 8 rows (zero rows pad n)."""
    n, nb = d.shape
    pad = -n % GROUP
    qs, d, m = F.pad(qs, (0, 0, 0, 0, 0, pad)), F.pad(d, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
    g = qs.reshape(-1, GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4)  # [G, b, c, r, i]
    return (
        g.reshape(-1, nb, 128).contiguous(),
        d.reshape(-1, GROUP, nb).transpose(1, 2).contiguous(),
        m.reshape(-1, GROUP, nb).transpose(1, 2).contiguous(),
    )


def pack(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> QdotWeight:
    """GGUF bytes (or F16/F32 elements) of W [n, k] -> the kernel's layout.

    Q4_0/Q4_1/Q8_0 keep their codes; other types are dequantized exactly and requantized to int8
    per 32-block with a float32 scale (amax / 127), k zero-padded to a multiple of 32.
    """
    nb = -(-k // QK)
    t = qt.ggml_type
    if t in (_T.Q4_0, _T.Q4_1):
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0)
        start = 2 if t == _T.Q4_0 else 4
        m = -8 * d if t == _T.Q4_0 else f16_field(blocks, 2)
        qs = blocks[:, start : start + 16].reshape(n, nb, 16)
        return QdotWeight(True, n, k, *_interleave(qs, d.reshape(n, nb), m.reshape(n, nb)))
    if t == _T.Q8_0:
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0).reshape(n, nb)
        qs = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, nb, QK)
        return QdotWeight(False, n, k, qs.contiguous(), d.contiguous())
    w = F.pad(dequantize(raw, t, (n, k)), (0, nb * QK - k)).reshape(n, nb, QK)
    d = w.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    qs = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return QdotWeight(False, n, nb * QK, qs.contiguous(), d.contiguous())


def unpack(w: QdotWeight) -> torch.Tensor:
    """The float32 W [n, k] the packed blocks represent."""
    codes, d, m = w.rows()
    out = codes.float() * d[..., None]
    if m is not None:
        out = out + m[..., None]
    return out.reshape(w.n, w.k)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> xq int8 [T, K/32, 32], xd, xs float32 [T, K/32] in native code."""
    t, k = x.shape
    x = x.contiguous()
    xq = torch.empty(t, k // QK, QK, dtype=torch.int8)
    xd = torch.empty(t, k // QK)
    xs = torch.empty(t, k // QK)
    load().qdot_quantize(x.data_ptr(), t, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of `quantize_x` (same float32 operations, so bit-identical)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // QK, QK)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    return q.to(torch.int8), d, d * q.sum(dim=2)


def qdot_linear(x: torch.Tensor, w: QdotWeight, threads: int = 0) -> torch.Tensor:
    """x [T, K] float32 -> y [T, n] float32 through the native kernel (x quantized inside)."""
    if x.shape[1] != w.k:  # requantized weights with K padded to whole blocks
        x = F.pad(x, (0, w.k - x.shape[1]))
    m = w.m.data_ptr() if w.m is not None else None
    return linear_ptrs(x, w.is_q4, w.n, w.k, w.qs.data_ptr(), w.d.data_ptr(), m, threads)


def linear_ptrs(x: torch.Tensor, is_q4: bool, n: int, k: int, wq: int, wd: int, m, threads=0):
    """qdot_linear on weight pointers taken once (the model's per-call fast path)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n)
    if x.shape[0] == 0:
        return y
    threads = threads or torch.get_num_threads()
    ptrs = (wq, wd, m, x.data_ptr(), y.data_ptr())
    if load().qdot_linear(int(is_q4), n, k, x.shape[0], *ptrs, threads):
        raise MemoryError("qdot: no memory for the quantized activations")
    return y


def qdot_reference(x: torch.Tensor, w: QdotWeight) -> torch.Tensor:
    """What `qdot_linear` computes, in torch: exact integer block dots, the same scales."""
    xq, xd, xs = quantize_x_reference(F.pad(x, (0, w.k - x.shape[1])))
    codes, d, m = w.rows()
    dots = torch.einsum("tbj,nbj->tnb", xq.double(), codes.double())  # exact integers
    y = (dots * (d.double()[None] * xd.double()[:, None])).sum(-1)
    if m is not None:
        y = y + xs.double() @ m.double().t()
    return y.float()
