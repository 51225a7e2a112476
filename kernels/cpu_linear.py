"""y = x @ W^T on CPU with W kept in a packed format that a fast torch kernel reads.

Decode is memory-bound: each token reads every weight once, so a linear layer costs about
bytes(W) / bandwidth. Dequantizing GGUF weights to float32 at load makes every weight cost 4 bytes;
these schemes keep fewer bytes and use the kernels this torch ships for x86 CPUs. Which one wins at
which token count was measured, not assumed (benchmarks/cpu_linear.py); `choose_scheme` encodes
the result.

    scheme  weights (W [N, K])                 x rounded to    kernel                   bytes/w
    fp32    float32 [N, K]                     -               F.linear (MKL)           4
    bf16    bfloat16 [N, K]                    bfloat16        F.linear (oneDNN)        2
    fp16    float16, fbgemm-packed             -               fbgemm fp16 GEMM         2
    int8    int8 [N, K], bf16 scale per row    bfloat16        _weight_int8pack_mm      1
    int4    uint4, bf16 (scale, zero) per 32   bfloat16        _weight_int4pack_mm_*    0.625
    w8a8    int8 [N, K], scale per row         uint8 per call  fbgemm dynamic int8      1
    qdot    GGUF blocks as they are            int8 per block  C: VNNI / AVX2 / NEON    0.33-1.06
            (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4)

Measured on the 2-core AVX2 machine, SmolLM2-135M's linears streamed in model order, 2 threads
(shared machine: medians, +-30%): fp16 is nearly exact (weights rounded to fp16: 2e-4 relative;
logits within 0.03) and the fastest acceptable scheme from T=4 on (ms per step, fp16 vs fp32:
T=1 28 vs 45, T=4 37 vs 126, T=16 87 vs 245, T=64 271 vs 507). At T=1 int4 ties it on the
linears and wins by ~10% on whole-model decode in 3.2x less memory, for logits within ~0.4 on
Q4_1 (bf16 activations); from T=4 it falls behind: its AVX2 kernel is compute-bound (~3 GB/s of
weights against ~17 GB/s of bandwidth). bf16 matmul has no fast AVX2 path (4-10x slower from
T=4). w8a8 is fastest from T=4 on but quantizes x per tensor to 7 bits: logits off by up to 17.

qdot is llama.cpp's CPU scheme (kernels/cpu_qdot.py): the weights stay in their GGUF blocks and
x is rounded to int8 per 32 with a float scale (~5e-3 relative error per product, logits within
the BENCHMARKS.md figures). It reads 2.7x fewer bytes than fp16 on Q4_1 and is the CPU default
where a C compiler builds it: 2.6x faster than fp16 over SmolLM2's linears at T=1, on par at
T=16, ~15% slower at T=64 (1 thread, shared machine).

The int8/int4 kernels have AVX2 code for bfloat16 activations only (float32 goes down a scalar
loop, 10-50x slower), so they round x to bf16 and return bf16 outputs: the outputs carry bf16's
relative rounding of 2^-9. `packed_linear` still takes and returns float32.

int4 maps the legacy 4-bit blocks with no requantization: Q4_0 (w = d*(q-8)) and Q4_1
(w = d*q + m) keep their codes q in 0..15, and the kernel's form w = (q - 8)*s + z takes
s = bf16(d) and z = bf16(8s + m - (s - d)*mean(q)), the least-squares zero for the rounded scale
(z = m + 8d when d is a bf16 value). The only loss is the fp16 -> bf16 rounding of d and z.
Other types are requantized to 4-bit min/max groups of 32.

    int4 packed weight: _convert_weight_to_int4pack_for_cpu layout (CPU-capability dependent)
    int4 scales_and_zeros: bf16 [K/32, N, 2], [..., 0] = s, [..., 1] = z
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hetero.kernels import cpu_qdot
from hetero.quant import QuantType, dequantize, get_quant
from hetero.quant.bits import f16_field, low_high_nibbles

_T = GGMLQuantizationType
SCHEMES = ("fp32", "bf16", "fp16", "int8", "int4", "w8a8", "qdot")
INT4_GROUP = 32  # the legacy quant block: one (scale, zero) pair per 32 weights of a row
_K_ALIGN = 32  # the int8/int4 kernels read x rows with aligned 16-byte loads in steps of 8-32
_N_ALIGN = 16  # the int4 packer wants N % 16 == 0
_OPS = {
    "fp16": ("quantized", "linear_prepack_fp16"),
    "int8": ("aten", "_weight_int8pack_mm"),
    "int4": ("aten", "_weight_int4pack_mm_for_cpu"),
    "w8a8": ("quantized", "linear_dynamic"),
}


@functools.cache
def available_schemes() -> tuple[str, ...]:
    """The schemes whose kernels this torch build has (fbgemm ones are deprecated upstream)."""
    ok = []
    for s in SCHEMES:
        if s == "qdot":
            if cpu_qdot.available():
                ok.append(s)
            continue
        ns, name = _OPS.get(s, ("aten", "linear"))
        if hasattr(getattr(torch.ops, ns), name):
            ok.append(s)
    return tuple(ok)


@dataclass(eq=False)
class PackedLinear:
    """A weight W [N, K] in one scheme's layout; `packed_linear(x, p)` computes x @ W^T."""

    scheme: str
    out_features: int  # N
    in_features: int  # K
    weight: Any  # a tensor, or an fbgemm packed-params object (fp16, w8a8)
    scales: torch.Tensor | None = None  # int8: bf16 [N]; int4: bf16 [K/32, N, 2] (scale, zero)
    k_padded: int = 0  # K and N as the kernel sees them (zero padding to its alignment)
    n_padded: int = 0

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype x is rounded to before the product (w8a8: further quantized to 8 bits)."""
        return torch.bfloat16 if self.scheme in ("bf16", "int8", "int4") else torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes of weight data one call reads."""
        n, k = self.n_padded, self.k_padded
        if self.scheme == "qdot":
            return self.weight.nbytes
        per = {"fp32": 4 * n * k, "bf16": 2 * n * k, "fp16": 2 * n * k, "w8a8": n * k + 8 * n}
        if self.scheme in per:
            return per[self.scheme]
        return int(self.weight.numel() * self.weight.element_size() + self.scales.nbytes)


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; schemes: {', '.join(SCHEMES)}")
    if scheme not in available_schemes():
        raise ValueError(f"scheme {scheme!r} needs torch ops this torch build lacks")


def _check_shape(raw: torch.Tensor, qt: QuantType, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"a linear weight needs a 2-D shape (N, K), got {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if raw.dtype == torch.uint8:
        expected = n * qt.row_bytes(k)
        if raw.numel() != expected:
            raise ValueError(f"{qt.name} {n}x{k}: expected {expected} bytes, got {raw.numel()}")
    return n, k


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def pack_linear(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType | int | str, shape, scheme: str
) -> PackedLinear:
    """Pack a GGUF weight of logical shape (N, K) into `scheme`.

    raw: the tensor's bytes (N, row_bytes) uint8, or float16/float32 elements for F16/F32.
    Raises ValueError for an unknown or unavailable scheme, an unsupported GGUF type
    (hetero.quant.UnsupportedTensorType) or bytes that do not fit the shape.
    """
    _check_scheme(scheme)
    qt = get_quant(ggml_type)
    n, k = _check_shape(raw, qt, tuple(shape))
    if scheme == "int4":
        return _pack_int4(raw, qt, n, k)
    if scheme == "qdot":
        return _pack_qdot(raw, qt, n, k)
    w = dequantize(raw, qt.ggml_type, (n, k)).contiguous()  # [N, K] float32, exact
    if not torch.isfinite(w).all():
        raise ValueError(f"{qt.name} {n}x{k}: weights hold inf/nan")
    return _PACKERS[scheme](w)


def _pack_fp32(w: torch.Tensor) -> PackedLinear:
    n, k = w.shape
    return PackedLinear("fp32", n, k, w, k_padded=k, n_padded=n)


def _pack_bf16(w: torch.Tensor) -> PackedLinear:
    n, k = w.shape
    return PackedLinear("bf16", n, k, w.to(torch.bfloat16), k_padded=k, n_padded=n)


def _pack_fp16(w: torch.Tensor) -> PackedLinear:
    n, k = w.shape
    big = float(w.abs().max())
    if big > torch.finfo(torch.float16).max:
        raise ValueError(f"fp16 cannot hold weights up to {big:g}")
    handle = torch.ops.quantized.linear_prepack_fp16(w, None)
    return PackedLinear("fp16", n, k, handle, k_padded=k, n_padded=n)


def _row_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~ q * s, q in -127..127; s [N] rounded to `scale_dtype`."""
    s = (w.abs().amax(dim=1) / 127).to(scale_dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero rows: any scale, codes are 0
    q = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def _pack_int8(w: torch.Tensor) -> PackedLinear:
    n, k = w.shape
    kp = _round_up(k, _K_ALIGN)
    q, s = _row_int8(F.pad(w, (0, kp - k)), torch.bfloat16)
    return PackedLinear("int8", n, k, q.contiguous(), s, k_padded=kp, n_padded=n)


def _pack_w8a8(w: torch.Tensor) -> PackedLinear:
    n, k = w.shape
    q, s = _row_int8(w, torch.float32)
    zero = torch.zeros(n, dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor constructors are deprecated upstream
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), zero, 0)
    handle = torch.ops.quantized.linear_prepack(qw, None)
    return PackedLinear("w8a8", n, k, handle, k_padded=k, n_padded=n)


def _legacy4_codes(raw: torch.Tensor, qt: QuantType) -> tuple[torch.Tensor, ...]:
    """Q4_0 / Q4_1 bytes -> codes (n_blocks, 32) uint8, d and m (n_blocks, 1) float32.

    Q4_0 block (18 B): | d f16 | qs[16] |      w = d*q - 8d
    Q4_1 block (20 B): | d f16 | m f16 | qs[16] |  w = d*q + m
    byte j of qs: low nibble -> element j, high nibble -> element j + 16
    """
    blocks = raw.reshape(-1, qt.type_size)
    d = f16_field(blocks, 0)
    start = 2 if qt.ggml_type == _T.Q4_0 else 4
    m = -8 * d if qt.ggml_type == _T.Q4_0 else f16_field(blocks, 2)
    codes = low_high_nibbles(blocks[:, start : start + 16].unsqueeze(1)).reshape(-1, 32)
    return codes, d, m


def _minmax4_codes(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Groups (n_groups, 32) float32 -> 4-bit min/max codes, d and m (n_groups, 1): w ~ d*q + m."""
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((w - lo) / safe).clamp_(0, 15).to(torch.uint8)
    return codes, d, lo


def _pack_int4(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> PackedLinear:
    if qt.ggml_type in (_T.Q4_0, _T.Q4_1):
        kp = k  # whole 32-blocks already
        codes, d, m = _legacy4_codes(raw, qt)
        if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
            raise ValueError(f"{qt.name} {n}x{k}: block scales hold inf/nan")
    else:
        kp = _round_up(k, INT4_GROUP)
        w = F.pad(dequantize(raw, qt.ggml_type, (n, k)), (0, kp - k))
        if not torch.isfinite(w).all():
            raise ValueError(f"{qt.name} {n}x{k}: weights hold inf/nan")
        codes, d, m = _minmax4_codes(w.reshape(-1, INT4_GROUP))
    s = d.to(torch.bfloat16)
    # least-squares zero for the rounded scale: (q-8)*s + z ~ d*q + m over the group's codes
    z = 8 * s.float() + m - (s.float() - d) * codes.float().mean(dim=1, keepdim=True)
    groups = kp // INT4_GROUP
    np_ = _round_up(n, _N_ALIGN)
    codes = F.pad(codes.reshape(n, kp), (0, 0, 0, np_ - n)).to(torch.int32)
    sz = torch.cat((s, z.to(torch.bfloat16)), dim=1).reshape(n, groups, 2)
    sz = F.pad(sz, (0, 0, 0, 0, 0, np_ - n)).transpose(0, 1).contiguous()  # [K/32, Np, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return PackedLinear("int4", n, k, packed, sz, k_padded=kp, n_padded=np_)


def _pack_qdot(raw: torch.Tensor, qt: QuantType, n: int, k: int) -> PackedLinear:
    if qt.ggml_type not in cpu_qdot.NATIVE_TYPES:
        raise ValueError(f"qdot reads {', '.join(t.name for t in cpu_qdot.NATIVE_TYPES)} blocks")
    w = cpu_qdot.pack(raw, qt, n, k)
    halves = [  # the blocks' fp16 scales (d, dmin, m): finite, or the layer's outputs are not
        raw.reshape(-1, qt.type_size)[:, o : o + 2].contiguous().view(torch.float16)
        for o, size, elem in cpu_qdot.FIELDS[qt.ggml_type]
        if elem == 2
    ]
    if not all(bool(torch.isfinite(h).all()) for h in halves):
        raise ValueError(f"{qt.name} {n}x{k}: block scales hold inf/nan")
    return PackedLinear("qdot", n, k, w, k_padded=k, n_padded=n)


_PACKERS = {
    "fp32": _pack_fp32,
    "bf16": _pack_bf16,
    "fp16": _pack_fp16,
    "int8": _pack_int8,
    "w8a8": _pack_w8a8,
}


def packed_linear(x: torch.Tensor, p: PackedLinear) -> torch.Tensor:
    """x [T, K] float32 -> x @ W^T [T, N] float32, W being what `p` represents."""
    if x.dim() != 2 or x.shape[1] != p.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [T, {p.in_features}], got {x.dtype} {tuple(x.shape)}")
    if p.scheme == "fp32":
        return F.linear(x, p.weight)
    if p.scheme == "qdot":
        return cpu_qdot.qdot_linear(x, p.weight)
    if p.scheme == "fp16":
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), p.weight)
    if p.scheme == "w8a8":
        # reduce_range: AVX2 without VNNI sums u8*s8 pairs in int16, which saturates when
        # activations use all 8 bits (measured: 20% output error); 7-bit ones cannot saturate
        return torch.ops.quantized.linear_dynamic(x.contiguous(), p.weight, True)
    xb = x.to(torch.bfloat16)
    if p.scheme == "bf16":
        return F.linear(xb, p.weight).float()
    if p.k_padded != p.in_features:
        xb = F.pad(xb, (0, p.k_padded - p.in_features))
    xb = xb.contiguous()  # the kernels' aligned loads need dense rows (a strided x segfaults)
    if p.scheme == "int8":
        y = torch.ops.aten._weight_int8pack_mm(xb, p.weight, p.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.weight, INT4_GROUP, p.scales)
    return y[:, : p.out_features].float()


def unpack(p: PackedLinear) -> torch.Tensor:
    """The float32 weight W [N, K] that `p` represents (what its kernel multiplies by)."""
    n, k = p.out_features, p.in_features
    if p.scheme in ("fp32", "bf16"):
        return p.weight.float()
    if p.scheme == "qdot":
        return cpu_qdot.unpack(p.weight)[:, :k]
    if p.scheme == "fp16":
        return torch.ops.quantized.linear_unpack_fp16(p.weight)[0]
    if p.scheme == "w8a8":
        return torch.ops.quantized.linear_unpack(p.weight)[0].dequantize().float()
    if p.scheme == "int8":
        return (p.weight.float() * p.scales.float()[:, None])[:, :k]
    # int4: read the codes back through the kernel itself (the packed layout depends on the CPU):
    # one-hot rows of x with (scale 1, zero 8) give (q - 8) + 8 = q, exact in bf16
    ones = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand_as(p.scales).contiguous()
    eye = torch.eye(p.k_padded, dtype=torch.bfloat16)
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, p.weight, INT4_GROUP, ones)
    s, z = p.scales.float().unbind(-1)  # [K/32, Np] each
    zero = z - 8 * s  # as the kernel forms it in fp32 (exact: 8s and z are bf16)
    w = codes.float() * s.repeat_interleave(INT4_GROUP, 0) + zero.repeat_interleave(INT4_GROUP, 0)
    return w.t()[:n, :k].contiguous()


def pack_error(raw: torch.Tensor, ggml_type, shape, scheme: str) -> float:
    """Relative RMS error ||W_packed - W|| / ||W|| against the exact dequantized weights."""
    p = pack_linear(raw, ggml_type, shape, scheme)
    ref = dequantize(raw, ggml_type, tuple(shape))
    norm = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(unpack(p) - ref))
    return diff / norm if norm > 0 else diff


# Fastest first, per token count (upper bound of the range), measured on a 2-core AVX2 machine by
# benchmarks/cpu_linear.py, SmolLM2-135M's linears streamed in model order (ms per step, 2
# threads; T=1: int4 28, fp16 28, int8 35, bf16 41, fp32 45, and int4 ahead in whole-model
# decode, 30-35 vs 35-39 ms per token; T=4: fp16 37, int4 66, fp32 126; T=16: fp16 87, int8 198,
# int4 204, fp32 245; T=64: fp16 271, fp32 507, int8 621, int4 756). w8a8 is left out: its
# per-tensor 7-bit activations cost whole logits on a real model.
# qdot (kernels/cpu_qdot.py), measured later the same way with 1 thread on the shared machine:
# T=1 14 vs fp16 37 ms, T=16 94 vs 92, T=64 365 vs 311 (its int8 dot products are bound by
# maddubs throughput without AVX-VNNI); its pack_error counts the weights only (0 for
# Q4_0/Q4_1/Q8_0), not its int8 activations (~5e-3 relative per product).
SPEED_ORDER: tuple[tuple[int, tuple[str, ...]], ...] = (
    (1, ("qdot", "int4", "fp16", "int8", "bf16", "fp32")),
    (16, ("qdot", "fp16", "int4", "int8", "fp32", "bf16")),
    (1 << 62, ("fp16", "qdot", "fp32", "int8", "int4", "bf16")),
)
# Relative RMS weight error admitted by default: int4 on Q4_0/Q4_1 (~2e-3), bf16, fp16 pass;
# per-row int8 (~1e-2) and 4-bit requantization of 5-8-bit types (>= 1e-2) do not.
DEFAULT_MAX_ERROR = 4e-3


def choose_scheme(
    raw: torch.Tensor,
    ggml_type,
    shape,
    tokens: int = 1,
    max_error: float = DEFAULT_MAX_ERROR,
    candidates: tuple[str, ...] | None = None,
) -> str:
    """The fastest scheme for `tokens` rows per call whose `pack_error` is at most `max_error`.

    Packs each candidate in speed order until one passes (fp32, exact, always does), so it costs
    up to a few packings of the tensor at load time.
    """
    allowed = set(candidates) if candidates is not None else set(SCHEMES)
    for s in allowed:
        _check_scheme(s)
    order = next(o for limit, o in SPEED_ORDER if tokens <= limit)
    order = order + tuple(s for s in SCHEMES if s not in order)
    for scheme in order:
        if scheme not in allowed or scheme not in available_schemes():
            continue
        try:
            if scheme == "fp32" or pack_error(raw, ggml_type, shape, scheme) <= max_error:
                return scheme
        except ValueError:  # e.g. weights beyond fp16's range
            continue
    return "fp32"
