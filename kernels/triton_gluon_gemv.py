"""One token's GEMV over 4-bit codes (Q4_K, Q4_0, Q4_1; Q6_K with its high plane), lanes
along K, in Gluon (Triton's language with explicit layouts).

The Stream-K kernels (triton_streamk_kernels, triton_streamk_rows) leave the layout of their
[BN, S, 4] tiles to Triton and read at 1.1-2.3 TB/s on the H200 (35-55% of the copy rate),
bound neither by DRAM (the same weight warm in L2 reads hardly faster) nor by the issue of their
instructions: a thread's loads wait on each other. Here the layout says what each thread does:

- a program takes R rows and walks K in tiles of C = 32 CPL WK chunks (32 codes, 16 bytes a
  chunk): lane l of warp w takes chunks cpl 32 WK + 32 w + l (each load instruction of a warp
  reads 512 contiguous bytes of a row), and every thread issues its R x CPL 16-byte code loads
  of a tile, with their scale bytes, before it uses any of them;
- x comes as xquant's integer words (the norm or the SiLU before the linear already made them):
  a thread's chunks of x, 64 bytes each, stay in its registers for the R rows;
- per chunk 8 dp4a (the low and high nibbles of 4 code words against x's hi and lo bytes) and
  one float FMA chain: A s_b (isum + OFF S) - B s_b S, as `triton_streamk_kernels._unit_value`;
- the row sums (threads, then warps) once a row block; no split-K, no fix-up, no counters;
- a program a row block, or (PERSIST: a config's ctas_per_sm) P programs each walking every
  P-th block, the next block's first tile loading during the last tile of this one: a weight
  of one tile a row (K 4096 at 4 warps) keeps its loads in flight across blocks too.
- Q6_K (HB 2, two groups of 16 a chunk): the high plane in the integer GEMV's "bytes"
  arrangement (2 words a chunk: code word c's high bits of shift j at bits 2 ((2c + j) % 4) of
  each byte of word c // 2) is shifted beside the low nibbles, and one PRMT a group regroups
  the bytes of both shifts so that each word holds one group of 16 (`xquant.dot_elements`);
  16 dp4a a chunk, each group its own scale.

Programmatic dependent launch (sm_90+): the first tile's codes and scales load before the wait
for the previous kernel (x depends on it, the weights do not), and the next kernel may launch
at once. Gluon compiles but does not run under the interpreter: tests/kernels/test_gluon_gemv.py
compiles it for each target architecture on any machine and compares it with the reference and
the Stream-K kernel where CUDA is.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hetero.kernels.triton_gluon_moe import _shl, _split4


@gluon.jit
def _dp4a(a, b, acc, SIGNED_B: gl.constexpr):
    """acc + sum over bytes of a (unsigned) times b (signed or unsigned bytes): PTX dp4a."""
    if SIGNED_B:
        return gl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], gl.int32, True, 1
        )
    return gl.inline_asm_elementwise(
        "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], gl.int32, True, 1
    )


@gluon.jit
def _pick16(v, i: gl.constexpr):
    """[..., 16] -> [...]: element i of the last dimension (in one thread)."""
    v = _split4(gl.reshape(v, v.shape[:-1] + [4, 4]))[i % 4]
    return _split4(v)[i // 4]


@gluon.jit
def _prmt(a, b, sel: gl.constexpr):
    """Bytes of (a, b) (0-3: a's, 4-7: b's) picked by the 4 nibbles of sel, low first."""
    return gl.inline_asm_elementwise(
        f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], gl.int32, True, 1
    )


@gluon.jit
def _tile_loads(
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, w_off, h_off, g_off, sb_off, ch2,
    k0, n_chunks, L2: gl.constexpr, LH: gl.constexpr, HB: gl.constexpr, G: gl.constexpr,
    KQUANT: gl.constexpr, HAS_MIN: gl.constexpr, FULL: gl.constexpr,
):  # fmt: skip
    """A tile's code words [R, C, 4], high words [R, C, 2] (HB 2: Q6_K's "bytes" plane; the
    code words again without one) and per-chunk factors [R, C] float32: A of each group of the
    chunk (a0, a1: one group of 32, or two of 16) and B."""
    m2 = (k0 + ch2) < n_chunks
    words = _load(codes_ptr + k0 * 4 + w_off, gl.expand_dims(m2, 2), FULL)
    if G == 16:  # [R, C, 2]: the chunk's two groups
        sc = _load(scale_ptr + k0 * 2 + g_off, _mask_h(m2, LH), FULL)
    else:
        sc = _load(scale_ptr + k0 + g_off, m2, FULL)
    if HB > 0:
        high = _load(high_ptr + k0 * 2 + h_off, _mask_h(m2, LH), FULL)
    else:
        high = words
    if G == 16:
        sc0 = gl.convert_layout(_pick2(sc, 0), L2, assert_trivial=True).to(gl.float32)
        sc1 = gl.convert_layout(_pick2(sc, 1), L2, assert_trivial=True).to(gl.float32)
    else:
        sc0 = sc.to(gl.float32)
        sc1 = sc0
    if HAS_MIN:
        mn = _load(min_ptr + k0 + g_off, m2, FULL).to(gl.float32)
    if KQUANT:
        sb = (k0 + ch2) // (256 // 32) + sb_off  # the chunk's super-block
        d = _load(d_ptr + sb, m2, FULL).to(gl.float32)
        a0 = d * sc0
        a1 = d * sc1
        if HAS_MIN:
            b = _load(dmin_ptr + sb, m2, FULL).to(gl.float32) * mn
        else:
            b = gl.zeros_like(a0)
    else:
        a0 = sc0
        a1 = sc1
        if HAS_MIN:
            b = -mn
        else:
            b = gl.zeros_like(a0)
    return words, high, a0, a1, b


@gluon.jit
def _load(ptr, mask, FULL: gl.constexpr):
    """gl.load, unmasked where the tiles fill K (FULL), else masked (0 past it)."""
    if FULL:
        out = gl.load(ptr)
    else:
        out = gl.load(ptr, mask=mask, other=0)
    return out


@gluon.jit
def _mask_h(m2, LH: gl.constexpr):
    """m2 [R, C] as the mask of [R, C, 2] offsets in layout LH (high words, scale pairs)."""
    return gl.expand_dims(gl.convert_layout(m2, gl.SliceLayout(2, LH)), 2)


@gluon.jit
def _group_sums(words, high, xw, c: gl.constexpr, hi0, lo0, hi1, lo1,
                L2: gl.constexpr, XS: gl.constexpr, HB: gl.constexpr):  # fmt: skip
    """The dp4a sums of code word c of every chunk: one group of 32 (hi0, lo0), or Q6_K's two
    groups of 16 (and hi1, lo1), against x's hi (signed) and lo (unsigned) bytes."""
    wc = gl.convert_layout(_split4(words)[c], L2, assert_trivial=True)
    if HB == 0:
        for q in gl.static_range(2):  # bytes k of shift q: elements 4(2k + q) + c
            qw = (wc >> (4 * q)) & 0x0F0F0F0F
            xh = gl.convert_layout(_pick16(xw, 4 * q + c), XS, assert_trivial=True)[None, :]
            xl = gl.convert_layout(_pick16(xw, 8 + 4 * q + c), XS, assert_trivial=True)[None, :]
            hi0 = _dp4a(qw, xh, hi0, True)
            lo0 = _dp4a(qw, xl, lo0, False)
    else:  # the high bits of (c, shift j) at 2 ((2c + j) % 4) of each byte of word c // 2
        hw = gl.convert_layout(_pick2(high, c // 2), L2, assert_trivial=True)
        q0 = (wc & 0x0F0F0F0F) | (_shl(hw, 4 - 2 * ((2 * c) % 4)) & 0x30303030)
        q1 = ((wc >> 4) & 0x0F0F0F0F) | (_shl(hw, 4 - 2 * ((2 * c + 1) % 4)) & 0x30303030)
        g0 = _prmt(q0, q1, 0x5410)  # bytes 0, 1 of both shifts: the chunk's first group
        g1 = _prmt(q0, q1, 0x7632)
        xh = gl.convert_layout(_pick16(xw, c), XS, assert_trivial=True)[None, :]
        xl = gl.convert_layout(_pick16(xw, 8 + c), XS, assert_trivial=True)[None, :]
        hi0 = _dp4a(g0, xh, hi0, True)
        lo0 = _dp4a(g0, xl, lo0, False)
        xh = gl.convert_layout(_pick16(xw, 4 + c), XS, assert_trivial=True)[None, :]
        xl = gl.convert_layout(_pick16(xw, 12 + c), XS, assert_trivial=True)[None, :]
        hi1 = _dp4a(g1, xh, hi1, True)
        lo1 = _dp4a(g1, xl, lo1, False)
    return hi0, lo0, hi1, lo1


@gluon.jit
def _row_offsets(
    rb, N, code_stride, grp_stride, sb_stride, ch2, R: gl.constexpr, L2: gl.constexpr,
    L3: gl.constexpr, LH: gl.constexpr, G: gl.constexpr, BIG: gl.constexpr,
):  # fmt: skip
    """The planes' offsets of row block rb's R rows (rows past N read row N - 1) at chunk 0:
    code words [R, C, 4], high words [R, C, 2], scales [R, C] (or [R, C, 2]: Q6_K's two
    groups a chunk), super-blocks [R, 1]."""
    r2 = gl.minimum(rb * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2)), N - 1)
    if BIG:
        r2 = r2.to(gl.int64)[:, None]
    else:
        r2 = r2[:, None]
    w_off = gl.expand_dims(r2 * code_stride + ch2 * 4, 2) + gl.arange(
        0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))
    )[None, None, :]  # fmt: skip
    two = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LH)))[None, None, :]
    r2h = gl.convert_layout(r2, gl.SliceLayout(2, LH))
    ch2h = gl.convert_layout(ch2, gl.SliceLayout(2, LH))
    h_off = gl.expand_dims(r2h * (code_stride // 2) + ch2h * 2, 2) + two
    if G == 16:  # the chunk's two scale bytes
        g_off = gl.expand_dims(r2h * grp_stride + ch2h * 2, 2) + two
    else:
        g_off = r2 * grp_stride + ch2
    return w_off, h_off, g_off, r2 * sb_stride


@gluon.jit
def _x_loads(xw_ptr, xf_ptr, x_off, f_off, xc, fc, k0, n_chunks,
             NF: gl.constexpr, FULL: gl.constexpr):  # fmt: skip
    """x's integer words [C, 16] and floats [C, NF] of the tile at chunk k0."""
    xw = _load(xw_ptr + k0 * 16 + x_off, (k0 + xc) < n_chunks, FULL)
    xf = _load(xf_ptr + k0 * NF + f_off, (k0 + fc) < n_chunks, FULL)
    return xw, xf


@gluon.jit
def _tile_acc(
    acc, words, high, a0, a1, b, xw, xf, OFF: gl.constexpr, NF: gl.constexpr, G: gl.constexpr,
    HB: gl.constexpr, L2: gl.constexpr, XS: gl.constexpr,
):  # fmt: skip
    """acc [R, C] + each chunk's share of W x: A s_b (isum + OFF S) - B S a group."""
    hi0 = gl.zeros(acc.shape, gl.int32, L2)
    lo0 = gl.zeros(acc.shape, gl.int32, L2)
    hi1 = gl.zeros(acc.shape, gl.int32, L2)
    lo1 = gl.zeros(acc.shape, gl.int32, L2)
    for c in gl.static_range(4):
        hi0, lo0, hi1, lo1 = _group_sums(words, high, xw, c, hi0, lo0, hi1, lo1, L2, XS, HB)
    s_b = gl.convert_layout(_pick_f(xf, 0, NF), XS, assert_trivial=True)[None, :]
    xs = gl.convert_layout(_pick_f(xf, 1, NF), XS, assert_trivial=True)[None, :]
    acc += a0 * (s_b * (hi0 * 256 + lo0).to(gl.float32) + OFF * xs) - b * xs
    if G == 16:
        s_b1 = gl.convert_layout(_pick_f(xf, 2, NF), XS, assert_trivial=True)[None, :]
        xs1 = gl.convert_layout(_pick_f(xf, 3, NF), XS, assert_trivial=True)[None, :]
        acc += a1 * (s_b1 * (hi1 * 256 + lo1).to(gl.float32) + OFF * xs1)
    return acc


@gluon.jit
def qgemv_lanes_kernel(
    xw_ptr, xf_ptr, y_ptr, codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, code_stride, grp_stride, sb_stride,
    HB: gl.constexpr, G: gl.constexpr, OFF: gl.constexpr, KQUANT: gl.constexpr,
    HAS_MIN: gl.constexpr, R: gl.constexpr, CPL: gl.constexpr, WK: gl.constexpr,
    FULL: gl.constexpr, PDL: gl.constexpr, BIG: gl.constexpr, PERSIST: gl.constexpr,
):  # fmt: skip
    """y[r] = W[r] x. Grid (cdiv(N, R),): a program a row block of R rows; PERSIST: grid (P,),
    program p takes row blocks p, p + P, ..., a unit = (block, tile of C chunks), the next
    unit's weights (the next block's too) loading while this one's arithmetic runs. Either way
    the next tile's loads are in flight during this one's dp4a. xw: xquant's words of x (int32
    [n_chunks, 16]: the hi words of shifts (or Q6_K's groups) 0 and 1, then the lo words, 4
    each), xf its floats (float32 [n_chunks, 64 // G]: s_b, s_b * sum m a unit). Rows past N
    read row N - 1 (never stored); FULL: n_chunks is a multiple of C (no masks); BIG: offsets
    past 2^31 (64-bit offsets, else 32-bit: fewer registers a row). HB 2, G 16: Q6_K, its high
    plane in the "bytes" arrangement (2 words a chunk)."""
    C: gl.constexpr = 32 * CPL * WK
    NF: gl.constexpr = 64 // G  # x's floats a chunk
    L3: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 32, 1], [1, WK, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    LH: gl.constexpr = gl.BlockedLayout([R, 1, 2], [1, 32, 1], [1, WK, 1], [2, 1, 0])
    XL: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [WK, 1], [1, 0])
    FL: gl.constexpr = gl.BlockedLayout([1, NF], [32, 1], [WK, 1], [1, 0])
    XS: gl.constexpr = gl.SliceLayout(0, L2)
    if PDL:
        gdc_launch_dependents()
    pid = gl.program_id(0)
    ch2 = gl.arange(0, C, layout=XS)[None, :]  # [1, C]
    strides = (N, code_stride, grp_stride, sb_stride, ch2)
    w_off, h_off, g_off, sb_off = _row_offsets(pid, *strides, R, L2, L3, LH, G, BIG)
    ptrs = (codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr)
    xc = gl.arange(0, C, layout=gl.SliceLayout(1, XL))[:, None]
    x_off = xc * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, XL))[None, :]
    fc = gl.arange(0, C, layout=gl.SliceLayout(1, FL))[:, None]
    f_off = fc * NF + gl.arange(0, NF, layout=gl.SliceLayout(0, FL))[None, :]
    xargs = (xw_ptr, xf_ptr, x_off, f_off, xc, fc)
    words, high, a0, a1, b = _tile_loads(
        *ptrs, w_off, h_off, g_off, sb_off, ch2, 0, n_chunks, L2, LH, HB, G, KQUANT, HAS_MIN,
        FULL,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    acc = gl.zeros([R, C], gl.float32, L2)
    if PERSIST:
        n_prog = gl.num_programs(0)
        kt_count = gl.cdiv(n_chunks, C)
        units = gl.cdiv(gl.cdiv(N, R) - pid, n_prog) * kt_count  # this program's
        for i in range(units):
            kt = i % kt_count
            rb = pid + (i // kt_count) * n_prog
            xw, xf = _x_loads(*xargs, kt * C, n_chunks, NF, FULL)
            if i + 1 < units:
                kt_n = (i + 1) % kt_count
                if kt_n == 0:  # the next row block
                    w_off, h_off, g_off, sb_off = _row_offsets(
                        rb + n_prog, *strides, R, L2, L3, LH, G, BIG
                    )
                n_words, n_high, n_a0, n_a1, n_b = _tile_loads(
                    *ptrs, w_off, h_off, g_off, sb_off, ch2, kt_n * C, n_chunks, L2, LH, HB,
                    G, KQUANT, HAS_MIN, FULL,
                )  # fmt: skip
            else:
                n_words, n_high, n_a0, n_a1, n_b = words, high, a0, a1, b
            acc = _tile_acc(acc, words, high, a0, a1, b, xw, xf, OFF, NF, G, HB, L2, XS)
            if kt == kt_count - 1:  # the row block's last tile: its sums out
                rows = rb * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2))
                y = gl.sum(acc, axis=1)
                gl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)
                acc = gl.zeros([R, C], gl.float32, L2)
            words, high, a0, a1, b = n_words, n_high, n_a0, n_a1, n_b
    else:
        for k0 in range(0, n_chunks, C):
            xw, xf = _x_loads(*xargs, k0, n_chunks, NF, FULL)
            if k0 + C < n_chunks:
                n_words, n_high, n_a0, n_a1, n_b = _tile_loads(
                    *ptrs, w_off, h_off, g_off, sb_off, ch2, k0 + C, n_chunks, L2, LH, HB, G,
                    KQUANT, HAS_MIN, FULL,
                )  # fmt: skip
            else:
                n_words, n_high, n_a0, n_a1, n_b = words, high, a0, a1, b
            acc = _tile_acc(acc, words, high, a0, a1, b, xw, xf, OFF, NF, G, HB, L2, XS)
            words, high, a0, a1, b = n_words, n_high, n_a0, n_a1, n_b
        rows = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2))
        y = gl.sum(acc, axis=1)
        gl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@gluon.jit
def _pick_f(v, i: gl.constexpr, n: gl.constexpr):
    """[C, n] -> [C]: element i of the last dimension, n 2 or 4 (in one thread)."""
    if n == 2:
        out = _pick2(v, i)
    else:
        out = _split4(v)[i]
    return out


@gluon.jit
def _pick2(v, i: gl.constexpr):
    """[..., 2] -> [...]: element i of the last dimension (in one thread)."""
    a, b = gl.split(v)
    return b if i == 1 else a
