"""One token's GEMV over 4-bit codes in groups of 32 (Q4_K, Q4_0, Q4_1), lanes along K, in
Gluon (Triton's language with explicit layouts).

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
- the row sums (threads, then warps) once at the end; no split-K, no fix-up, no counters.

Programmatic dependent launch (sm_90+): the first tile's codes and scales load before the wait
for the previous kernel (x depends on it, the weights do not), and the next kernel may launch
at once. Gluon compiles but does not run under the interpreter: tests/kernels/test_gluon_gemv.py
compiles it for each target architecture on any machine and compares it with the reference and
the Stream-K kernel where CUDA is.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
def _gdc_wait():
    """Wait for the kernel before this one (programmatic dependent launch; a no-op without)."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _gdc_launch_dependents():
    """Let the next kernel launch now (its programs wait for this one's end to read)."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _pick4(v, i: gl.constexpr):
    """[..., 4] -> [...]: element i of the last dimension (held in one thread: no data moves)."""
    v = gl.reshape(v, v.shape[:-1] + [2, 2])
    a, b = gl.split(v)
    v = b if i % 2 == 1 else a
    a, b = gl.split(v)
    return b if i // 2 == 1 else a


@gluon.jit
def _pick16(v, i: gl.constexpr):
    """[..., 16] -> [...]: element i of the last dimension (in one thread)."""
    v = _pick4(gl.reshape(v, v.shape[:-1] + [4, 4]), i % 4)
    return _pick4(v, i // 4)


@gluon.jit
def _tile_loads(
    codes_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, w_off, g_off, sb_off, ch2, k0, n_chunks,
    KQUANT: gl.constexpr, HAS_MIN: gl.constexpr, FULL: gl.constexpr,
):  # fmt: skip
    """A tile's code words [R, C, 4] and per-chunk (A, B) factors [R, C] as float32."""
    if FULL:
        words = gl.load(codes_ptr + k0 * 4 + w_off)
        sc = gl.load(scale_ptr + k0 + g_off).to(gl.float32)
        if HAS_MIN:
            mn = gl.load(min_ptr + k0 + g_off).to(gl.float32)
        if KQUANT:
            d = gl.load(d_ptr + (k0 + ch2) // 8 + sb_off).to(gl.float32)
            if HAS_MIN:
                dmin = gl.load(dmin_ptr + (k0 + ch2) // 8 + sb_off).to(gl.float32)
    else:
        m2 = (k0 + ch2) < n_chunks
        m3 = gl.expand_dims(m2, 2)
        words = gl.load(codes_ptr + k0 * 4 + w_off, mask=m3, other=0)
        sc = gl.load(scale_ptr + k0 + g_off, mask=m2, other=0).to(gl.float32)
        if HAS_MIN:
            mn = gl.load(min_ptr + k0 + g_off, mask=m2, other=0).to(gl.float32)
        if KQUANT:
            d = gl.load(d_ptr + (k0 + ch2) // 8 + sb_off, mask=m2, other=0).to(gl.float32)
            if HAS_MIN:
                dmin = gl.load(dmin_ptr + (k0 + ch2) // 8 + sb_off, mask=m2, other=0)
                dmin = dmin.to(gl.float32)
    if KQUANT:
        a = d * sc
        if HAS_MIN:
            b = dmin * mn
        else:
            b = gl.zeros_like(a)
    else:
        a = sc
        if HAS_MIN:
            b = -mn
        else:
            b = gl.zeros_like(a)
    return words, a, b


@gluon.jit
def qgemv_lanes_kernel(
    xw_ptr, xf_ptr, y_ptr, codes_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, code_stride, grp_stride, sb_stride,
    OFF: gl.constexpr, KQUANT: gl.constexpr, HAS_MIN: gl.constexpr,
    R: gl.constexpr, CPL: gl.constexpr, WK: gl.constexpr, FULL: gl.constexpr,
    PDL: gl.constexpr, BIG: gl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N, R),): y[r] = W[r] x for the program's R rows. xw: xquant's words of x
    (int32 [n_chunks, 16]: the hi words of shifts 0 and 1, then the lo words, 4 each), xf its
    floats (float32 [n_chunks, 2]: s_b, s_b * sum m). Rows past N read row N - 1 (never
    stored); FULL: n_chunks is a multiple of C (no masks); BIG: offsets past 2^31 (64-bit
    offsets, else 32-bit: fewer registers a row)."""
    C: gl.constexpr = 32 * CPL * WK
    L3: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 32, 1], [1, WK, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    XL: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [WK, 1], [1, 0])
    FL: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WK, 1], [1, 0])
    XS: gl.constexpr = gl.SliceLayout(0, L2)
    if PDL:
        _gdc_launch_dependents()
    pid = gl.program_id(0)
    r2 = gl.minimum(pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2)), N - 1)
    ch2 = gl.arange(0, C, layout=XS)[None, :]  # [1, C]
    if BIG:
        r2 = r2.to(gl.int64)[:, None]
    else:
        r2 = r2[:, None]
    w_off = gl.expand_dims(r2 * code_stride + ch2 * 4, 2) + gl.arange(
        0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))
    )[None, None, :]  # fmt: skip
    g_off = r2 * grp_stride + ch2
    sb_off = r2 * sb_stride
    xc = gl.arange(0, C, layout=gl.SliceLayout(1, XL))[:, None]
    x_off = xc * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, XL))[None, :]
    fc = gl.arange(0, C, layout=gl.SliceLayout(1, FL))[:, None]
    f_off = fc * 2 + gl.arange(0, 2, layout=gl.SliceLayout(0, FL))[None, :]
    planes = (codes_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, w_off, g_off, sb_off, ch2)
    words, a, b = _tile_loads(*planes, 0, n_chunks, KQUANT, HAS_MIN, FULL)
    if PDL:
        _gdc_wait()
    acc = gl.zeros([R, C], gl.float32, L2)
    for k0 in range(0, n_chunks, C):
        if FULL:
            xw = gl.load(xw_ptr + k0 * 16 + x_off)
            xf = gl.load(xf_ptr + k0 * 2 + f_off)
        else:
            xw = gl.load(xw_ptr + k0 * 16 + x_off, mask=(k0 + xc) < n_chunks, other=0)
            xf = gl.load(xf_ptr + k0 * 2 + f_off, mask=(k0 + fc) < n_chunks, other=0.0)
        nxt = k0 + C
        if nxt < n_chunks:  # the next tile's loads in flight during this one's arithmetic
            n_words, n_a, n_b = _tile_loads(*planes, nxt, n_chunks, KQUANT, HAS_MIN, FULL)
        else:
            n_words, n_a, n_b = words, a, b
        hi = gl.zeros([R, C], gl.int32, L2)
        lo = gl.zeros([R, C], gl.int32, L2)
        for c in gl.static_range(4):
            wc = gl.convert_layout(_pick4(words, c), L2, assert_trivial=True)
            for q in gl.static_range(2):
                qw = (wc >> (4 * q)) & 0x0F0F0F0F
                xh = gl.convert_layout(_pick16(xw, 4 * q + c), XS, assert_trivial=True)
                xl = gl.convert_layout(_pick16(xw, 8 + 4 * q + c), XS, assert_trivial=True)
                hi = _dp4a(qw, xh[None, :], hi, True)
                lo = _dp4a(qw, xl[None, :], lo, False)
        s_b = gl.convert_layout(_pick2(xf, 0), XS, assert_trivial=True)[None, :]
        xs = gl.convert_layout(_pick2(xf, 1), XS, assert_trivial=True)[None, :]
        isum = (hi * 256 + lo).to(gl.float32)
        acc += a * (s_b * isum + OFF * xs) - b * xs
        words, a, b = n_words, n_a, n_b
    y = gl.sum(acc, axis=1)
    rows = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2))
    gl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@gluon.jit
def _pick2(v, i: gl.constexpr):
    """[..., 2] -> [...]: element i of the last dimension (in one thread)."""
    a, b = gl.split(v)
    return b if i == 1 else a
