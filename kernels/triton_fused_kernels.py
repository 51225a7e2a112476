"""Triton kernels of the small fused ops: RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

Imported on first use only (it imports triton); wrappers and registrations are in
kernels/triton_fused.py. Each computes in float32 and rounds once, as the references do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_pdl import pdl_wait


@triton.jit
def rms_norm_kernel(
    x, res, w, out, res_out, eps, C, sx, sr, so, sro,
    BC: tl.constexpr, ADD: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (rows,): out = rms_norm(x [+ res]) * w. With ADD the sum, rounded to x's dtype, is
    stored to res_out and normalized (the reference rounds x + res first as well)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    cm = c < C
    v = tl.load(x + r * sx + c, mask=cm, other=0.0)
    if ADD:
        v = v + tl.load(res + r * sr + c, mask=cm, other=0.0)
        tl.store(res_out + r * sro + c, v, mask=cm)
    v = v.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(v * v, axis=0) / C + eps)
    g = tl.load(w + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(out + r * so + c, (v * inv * g).to(out.dtype.element_ty), mask=cm)


@triton.jit
def _rotate_pairs(
    src, dst, cs, sn, R, w, inv, BR: tl.constexpr, NEOX: tl.constexpr, NORM: tl.constexpr
):  # fmt: skip
    """One head's first 2R dims: pairs (src[2i], src[2i+1]) (normal, GGML) or (src[i],
    src[i + R]) (neox) rotated by cs[i], sn[i] into dst. NORM: each value first times inv and
    its weight w, rounded to dst's dtype (what an unfused norm would have stored)."""
    i = tl.arange(0, BR)
    im = i < R
    if NEOX:
        ia, ib = i, i + R
    else:
        ia, ib = 2 * i, 2 * i + 1
    ty = dst.dtype.element_ty
    a = tl.load(src + ia, mask=im, other=0.0).to(tl.float32)
    b = tl.load(src + ib, mask=im, other=0.0).to(tl.float32)
    if NORM:
        a = (a * inv * tl.load(w + ia, mask=im, other=0.0)).to(ty).to(tl.float32)
        b = (b * inv * tl.load(w + ib, mask=im, other=0.0)).to(ty).to(tl.float32)
    c = tl.load(cs + i, mask=im, other=0.0)
    s = tl.load(sn + i, mask=im, other=0.0)
    tl.store(dst + ia, (a * c - b * s).to(ty), mask=im)
    tl.store(dst + ib, (a * s + b * c).to(ty), mask=im)


@triton.jit
def _rotate_head(src, dst, cs, sn, R, D, BD: tl.constexpr, BR: tl.constexpr, NEOX: tl.constexpr):
    """One head's D dims from src to dst: the first 2R rotated (`_rotate_pairs`), the rest
    copied."""
    _rotate_pairs(src, dst, cs, sn, R, src, 1.0, BR, NEOX, False)
    d = tl.arange(0, BD)
    rest = (d >= 2 * R) & (d < D)
    tl.store(dst + d, tl.load(src + d, mask=rest), mask=rest)


@triton.jit
def rope_kernel(
    x, cos, sin, out, sx_t, sx_h, sc, so_t, so_h, R, D,
    BR: tl.constexpr, BD: tl.constexpr, NEOX: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, H): rotate the first 2R dims of x[t, h]; dims 2R .. D are copied.

    normal (GGML): pairs (x[2i], x[2i+1]); neox: pairs (x[i], x[i + R]); cos/sin [T, R]."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    src = x + t * sx_t + h * sx_h
    _rotate_head(src, out + t * so_t + h * so_h, cos + t * sc, sin + t * sc, R, D, BD, BR, NEOX)


@triton.jit
def qk_norm_rope_kernel(
    q, k, wq, wk, cos, sin, qo, ko, eps, sq_t, sq_h, sk_t, sk_h, sc, H, R, D,
    BR: tl.constexpr, BD: tl.constexpr, NEOX: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, H + KV): head h of q (h < H, weight wq) or h - H of k (wk): RMS-normalized over
    its D dims, rounded to the dtype as the unfused norm's output is, then its first 2R dims
    rotated as rope_kernel does; qo [T, H, D] and ko [T, KV, D] are contiguous."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < H:
        src = q + t * sq_t + h * sq_h
        dst = qo + (t * H + h) * D
        w = wq
    else:
        kv = tl.num_programs(1) - H
        src = k + t * sk_t + (h - H) * sk_h
        dst = ko + (t * kv + h - H) * D
        w = wk
    ty = qo.dtype.element_ty
    d = tl.arange(0, BD)
    dm = d < D
    v = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    rest = (d >= 2 * R) & dm  # not rotated: normalized only
    g = tl.load(w + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(dst + d, (v * inv * g).to(ty), mask=rest)
    _rotate_pairs(src, dst, cos + t * sc, sin + t * sc, R, w, inv, BR, NEOX, True)


@triton.jit
def swiglu_oai_kernel(
    gate, up, out, F, sg, su, so, alpha, limit, BF: tl.constexpr, PDL: tl.constexpr = False
):
    """Grid (T, F tiles): out = g sigmoid(alpha g) (clamp(up, -limit, limit) + 1), g =
    min(gate, limit), in float32."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = f < F
    g = tl.minimum(tl.load(gate + t * sg + f, mask=fm, other=0.0).to(tl.float32), limit)
    u = tl.load(up + t * su + f, mask=fm, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    tl.store(out + t * so + f, y.to(out.dtype.element_ty), mask=fm)


@triton.jit
def silu_mul_kernel(gate, up, out, F, sg, su, so, BF: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T, F tiles): out = silu(gate) * up, silu rounded to the dtype first (as torch's
    F.silu(gate) * up rounds twice)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    fm = f < F
    g = tl.load(gate + t * sg + f, mask=fm, other=0.0)
    u = tl.load(up + t * su + f, mask=fm, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out + t * so + f, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=fm)
