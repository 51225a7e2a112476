"""The "qdot" CPU linear: GGUF block weights times int8-quantized activations, in native code.

llama.cpp's CPU path: weights stay in 32-weight blocks (0.56-1.06 bytes per weight instead of
fp16's 2), each 32-block of x is rounded to int8 with a float32 scale, and blocks multiply as
integers (kernels/cpu_qdot.c: AVX2 maddubs/madd, a plain C loop elsewhere), built at first use
(kernels/native.py); where no compiler builds it, `available()` is False and the CPU linears
stay fp16.

    kind  GGUF types          qs                    d, m (float32 [N, K/32])   bytes/w
    q4    Q4_0, Q4_1          uint8 [N, K/32, 16]   w = d*q + m (Q4_0: m=-8d)  0.75
    q8    Q8_0                int8 [N, K/32, 32]    w = d*q                    1.125
    q8    others (requant)    int8 [N, K/32, 32]    d = amax/127 per block

Q4_0/Q4_1/Q8_0 keep their codes and scales (fp16 -> fp32, exact): the kernel multiplies by the
exact dequantized weights, and its only rounding is the int8 activations' (x ~ xd * xq per block,
|error| <= xd/2). `qdot_reference` does the same integer arithmetic in torch (float64 sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hetero.kernels import native
from hetero.quant import QuantType, dequantize
from hetero.quant.bits import f16_field

_T = GGMLQuantizationType
QK = 32
NATIVE_TYPES = (_T.Q4_0, _T.Q4_1, _T.Q8_0)


def load():
    return native.load()


def available() -> bool:
    return native.available()


def pack(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> tuple[bool, tuple[torch.Tensor, ...]]:
    """GGUF bytes (or F16/F32 elements) of W [N, K] -> (is_q4, (qs, d, m or None)).

    Q4_0/Q4_1/Q8_0 keep their codes; other types are dequantized exactly and requantized to int8
    per 32-block with a float32 scale (amax / 127), K zero-padded to a multiple of 32.
    """
    nb = -(-k // QK)
    t = qt.ggml_type
    if t in (_T.Q4_0, _T.Q4_1):
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0)
        start = 2 if t == _T.Q4_0 else 4
        m = -8 * d if t == _T.Q4_0 else f16_field(blocks, 2)
        qs = blocks[:, start : start + 16].reshape(n, nb, 16)
        return True, (qs.contiguous(), d.reshape(n, nb).contiguous(), m.reshape(n, nb).contiguous())
    if t == _T.Q8_0:
        blocks = raw.reshape(n * nb, qt.type_size)
        d = f16_field(blocks, 0).reshape(n, nb)
        qs = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, nb, QK)
        return False, (qs.contiguous(), d.contiguous(), None)
    w = F.pad(dequantize(raw, t, (n, k)), (0, nb * QK - k)).reshape(n, nb, QK)
    d = w.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    qs = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return False, (qs.contiguous(), d.contiguous(), None)


def unpack(is_q4: bool, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 W [N, K] the packed blocks represent."""
    n, nb = d.shape
    if is_q4:
        codes = torch.cat((qs & 15, qs >> 4), dim=2).float()  # [N, nb, 32]
        return (codes * d[..., None] + m[..., None]).reshape(n, nb * QK)
    return (qs.float() * d[..., None]).reshape(n, nb * QK)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> xq int8 [T, K/32, 32], xd, xs float32 [T, K/32] in native code."""
    lib = load()
    t, k = x.shape
    x = x.contiguous()
    xq = torch.empty(t, k // QK, QK, dtype=torch.int8)
    xd = torch.empty(t, k // QK)
    xs = torch.empty(t, k // QK)
    lib.qdot_quantize(x.data_ptr(), t, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of `quantize_x` (same float32 operations, so bit-identical)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // QK, QK)
    d = xb.abs().amax(dim=2) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    return q.to(torch.int8), d, d * q.sum(dim=2)


def qdot_linear(x: torch.Tensor, is_q4: bool, qs, d, m, threads: int = 0) -> torch.Tensor:
    """x [T, K] float32 -> y [T, N] float32 through the native kernel (x quantized inside)."""
    n, nb = d.shape
    if x.shape[1] != nb * QK:  # requantized weights with K padded to whole blocks
        x = F.pad(x, (0, nb * QK - x.shape[1]))
    return linear_ptrs(x, is_q4, n, nb * QK, qs.data_ptr(), d.data_ptr(), m, threads)


def linear_ptrs(x: torch.Tensor, is_q4: bool, n: int, k: int, wq: int, wd: int, m, threads=0):
    """qdot_linear on weight pointers taken once (the model's per-call fast path)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n)
    if x.shape[0] == 0:
        return y
    mp = m if isinstance(m, int) or m is None else m.data_ptr()
    threads = threads or torch.get_num_threads()
    if native.load().qdot_linear(
        int(is_q4), n, k, x.shape[0], wq, wd, mp, x.data_ptr(), y.data_ptr(), threads
    ):
        raise MemoryError("qdot: no memory for the quantized activations")
    return y


def qdot_reference(x: torch.Tensor, is_q4: bool, qs, d, m) -> torch.Tensor:
    """What `qdot_linear` computes, in torch: exact integer block dots, the same scales."""
    n, nb = d.shape
    xq, xd, xs = quantize_x_reference(F.pad(x, (0, nb * QK - x.shape[1])))
    if is_q4:
        codes = torch.cat((qs & 15, qs >> 4), dim=2)
    else:
        codes = qs
    dots = torch.einsum("tbj,nbj->tnb", xq.double(), codes.double())  # exact integers
    y = (dots * (d.double()[None] * xd.double()[:, None])).sum(-1)
    if is_q4:
        y = y + xs.double() @ m.double().t()
    return y.float()
