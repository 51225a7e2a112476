"""Triton kernel of `hetero.kernels.xquant` (layout and arithmetic there): activations to block
fixed point, bytes in the integer decode kernel's order. Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_pdl import pdl_wait


@triton.jit
def _dot_element(idx, LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr):
    """The chunk-local element of permuted position idx = (q, c, i) (xquant.dot_elements)."""
    J: tl.constexpr = 8 // LB
    q = idx // 16
    c = (idx // 4) % 4
    i = idx % 4
    if not REGROUP:
        el = 4 * (i * J + q) + c
    elif J == 2:
        el = 16 * q + 8 * (i % 2) + 4 * (i // 2) + c
    else:
        el = 16 * q + 4 * i + c
    return el


@triton.jit
def _to_words(b, N: tl.constexpr):
    """int32 bytes [N] (low 8 bits) -> int32 words [N/4]: byte i of each word at bits 8i (the
    bytes are disjoint, so the sum is their OR)."""
    b4 = tl.reshape(b & 255, [N // 4, 4])
    return tl.sum(b4 << (8 * tl.arange(0, 4))[None, :], axis=1)


@triton.jit
def _store_span(x, words_ptr, floats_ptr, t, base, K, E: tl.constexpr, GU: tl.constexpr,
                SPAN: tl.constexpr):  # fmt: skip
    """x float32 [SPAN] (the span's elements in dot order) -> its words and unit floats."""
    xb = tl.reshape(x, [SPAN // 32, 32])
    amax = tl.max(tl.abs(xb), axis=1)
    expo = (amax.to(tl.int32, bitcast=True) >> 23) & 255
    expo = tl.minimum(tl.maximum(expo, 15), 254)
    up = ((268 - expo) << 23).to(tl.float32, bitcast=True)  # 1 / s_b
    s_b = ((expo - 14) << 23).to(tl.float32, bitcast=True)
    v = xb * up[:, None] + 12582912.0  # rounds to an integer, half to even
    m = v.to(tl.int32, bitcast=True) - 0x4B400000
    m = tl.reshape(tl.minimum(tl.maximum(m, -32767), 32767), [SPAN])
    # words: per chunk the hi words, then the lo words (E / 4 each)
    w = tl.arange(0, SPAN // 4)
    wmask = base + 4 * w < K
    dst = words_ptr + t * (K // 2) + (base // E) * (E // 2) + (w // (E // 4)) * (E // 2)
    dst += w % (E // 4)
    tl.store(dst, _to_words(m >> 8, SPAN), mask=wmask)
    tl.store(dst + E // 4, _to_words(m, SPAN), mask=wmask)
    # floats: per unit (s_b, s_b * sum m)
    msum = tl.sum(tl.reshape(m, [SPAN // GU, GU]), axis=1).to(tl.float32)
    s_u = tl.reshape(tl.broadcast_to(s_b[:, None], [SPAN // 32, 32 // GU]), [SPAN // GU])
    u = tl.arange(0, SPAN // GU)
    fdst = floats_ptr + t * (K // GU * 2) + (base // GU + u) * 2
    umask = base + u * GU < K
    tl.store(fdst, s_u, mask=umask)
    tl.store(fdst + 1, s_u * msum, mask=umask)


@triton.jit
def _span_elements(LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr,
                   SPAN: tl.constexpr):  # fmt: skip
    """(program's first element, [SPAN] elements in dot order)."""
    E: tl.constexpr = 128 // LB
    base = tl.program_id(1) * SPAN
    idx = tl.arange(0, SPAN)
    return base, base + (idx // E) * E + _dot_element(idx % E, LB, GU, REGROUP)


@triton.jit(do_not_specialize=["K"])
def xquant_kernel(
    x_ptr, words_ptr, floats_ptr, K, x_stride,
    LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr, SPAN: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, K / SPAN): token t's elements [SPAN * pid, SPAN * (pid + 1)) -> its words and
    unit floats. SPAN holds whole chunks and blocks of 32."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    base, el = _span_elements(LB, GU, REGROUP, SPAN)
    x = tl.load(x_ptr + t * x_stride + el, mask=el < K, other=0).to(tl.float32)
    _store_span(x, words_ptr, floats_ptr, t, base, K, 128 // LB, GU, SPAN)


@triton.jit
def _norm_span(
    x_ptr, res_ptr, w_ptr, res_out_ptr, words_ptr, floats_ptr, inv, t, K, x_stride,
    res_stride, res_out_stride,
    LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr, SPAN: tl.constexpr,
    ADD: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """The program's span of the norm (inv: the row's 1 / rms) quantized in one layout; STORE
    (with ADD): the sum x + res stored to res_out too."""
    base, el = _span_elements(LB, GU, REGROUP, SPAN)
    em = el < K
    xs = tl.load(x_ptr + t * x_stride + el, mask=em, other=0.0)
    if ADD:
        xs = xs + tl.load(res_ptr + t * res_stride + el, mask=em, other=0.0)
        if STORE:
            tl.store(res_out_ptr + t * res_out_stride + el, xs, mask=em)
    g = tl.load(w_ptr + el, mask=em, other=0.0).to(tl.float32)
    y = (xs.to(tl.float32) * inv * g).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_span(y, words_ptr, floats_ptr, t, base, K, 128 // LB, GU, SPAN)


@triton.jit(do_not_specialize=["K"])
def add_rms_norm_xquant_kernel(
    x_ptr, res_ptr, w_ptr, res_out_ptr, words_ptr, floats_ptr, words2_ptr, floats2_ptr, eps, K,
    x_stride, res_stride, res_out_stride,
    LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr, SPAN: tl.constexpr,
    BK: tl.constexpr, ADD: tl.constexpr,
    TWO: tl.constexpr = False, LB2: tl.constexpr = 4, GU2: tl.constexpr = 32,
    REGROUP2: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, K / SPAN): rms_norm(x [+ res]) * w of token t, its span quantized as
    `xquant_kernel` does (the norm rounded to x's dtype first, as the unfused ops round it);
    with ADD the sum x + res (rounded to x's dtype) is stored to res_out by each span's
    program. Every program takes the row's mean square (K elements, from L2 after the first).
    TWO: the span quantized in a second layout too (LB2, GU2, REGROUP2; chunks no longer than
    the span) into words2 and floats2, for a linear whose parts read two (Q4_K_M's q|k beside
    a Q6_K v)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BK)
    v = tl.load(x_ptr + t * x_stride + c, mask=c < K, other=0.0)
    if ADD:
        v = v + tl.load(res_ptr + t * res_stride + c, mask=c < K, other=0.0)
    v = v.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(v * v, axis=0) / K + eps)
    _norm_span(
        x_ptr, res_ptr, w_ptr, res_out_ptr, words_ptr, floats_ptr, inv, t, K, x_stride,
        res_stride, res_out_stride, LB, GU, REGROUP, SPAN, ADD, True,
    )  # fmt: skip
    if TWO:
        _norm_span(
            x_ptr, res_ptr, w_ptr, res_out_ptr, words2_ptr, floats2_ptr, inv, t, K, x_stride,
            res_stride, res_out_stride, LB2, GU2, REGROUP2, SPAN, ADD, False,
        )  # fmt: skip


@triton.jit(do_not_specialize=["K", "alpha", "limit"])
def gated_xquant_kernel(
    gate_ptr, up_ptr, words_ptr, floats_ptr, K, g_stride, u_stride, alpha, limit,
    LB: tl.constexpr, GU: tl.constexpr, REGROUP: tl.constexpr, SPAN: tl.constexpr,
    SWIGLU: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, K / SPAN): silu(gate) * up of token t (rounded as the unfused ops round it:
    silu to the dtype, then the product), or with SWIGLU gpt-oss's clamped SwiGLU (as
    swiglu_oai_kernel: float32, rounded once), its span quantized as `xquant_kernel` does."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    base, el = _span_elements(LB, GU, REGROUP, SPAN)
    em = el < K
    g = tl.load(gate_ptr + t * g_stride + el, mask=em, other=0.0)
    u = tl.load(up_ptr + t * u_stride + el, mask=em, other=0.0)
    gf = g.to(tl.float32)
    if SWIGLU:
        gf = tl.minimum(gf, limit)
        uf = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit)
        y = (gf / (1.0 + tl.exp(-alpha * gf)) * (uf + 1.0)).to(g.dtype).to(tl.float32)
    else:
        sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        y = (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    _store_span(y, words_ptr, floats_ptr, t, base, K, 128 // LB, GU, SPAN)
