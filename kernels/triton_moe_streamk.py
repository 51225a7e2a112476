"""The MoE decode GEMV as a Stream-K kernel with a row a thread (wrapper: triton_moe).

A decode step's S = T x k slots each multiply one expert's matrix [N, K] by one activation row.
`_moe_gemv_kernel` ran a program per (slot, tile of rows) through the float decode loop; here
the slots' row tiles are the row tiles of one Stream-K schedule (triton_streamk_rows): global
tile g is row tile g % TILES of slot g // TILES, whose expert's rows start at ids[slot] * N, so
the P programs stream equal runs of units across all the slots, with integer dot products on
xquant'd activations (the dense decode's kernel, its unit loader and step unchanged; the
codebook types through their table bytes). No programmatic dependent launch: the first weights
to load depend on the routing the previous kernel writes.

Imported on first use (imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetero.kernels.triton_pdl import pdl_wait
from hetero.kernels.triton_qkernels import _split_k_store
from hetero.kernels.triton_streamk_kernels import _next_unit, _run, _tile_programs
from hetero.kernels.triton_streamk_rows import _load_rows_unit, _rows_int_step

NO_SPECIALIZE_MOE = [
    *("N", "n_chunks", "KS", "U", "P", "MAXC", "TILES", "x_div", "sb_stride", "zero"),
    *("xw_stride", "xf_stride", "y_stride", "bias_stride"),
]


@triton.jit
def _expert_unit(
    ids_ptr, codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, tile, ks, valid,
    TILES, N, n_chunks, code_stride, grp_stride, sb_stride,
    BN: tl.constexpr, S: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    """`_load_rows_unit` of global tile `tile`: its slot's expert's planes, its local tile."""
    e = tl.load(ids_ptr + tile // TILES, mask=valid, other=0).to(tl.int64)
    r0 = e * N  # the expert's first row of the packed [E * N, K] planes
    return _load_rows_unit(
        codes_ptr + r0 * code_stride, high_ptr + r0 * (code_stride * HB // LB),
        scale_ptr + r0 * grp_stride, min_ptr + r0 * grp_stride, d_ptr + r0 * sb_stride,
        dmin_ptr + r0 * sb_stride, tile % TILES, ks, valid, N, n_chunks, code_stride,
        grp_stride, sb_stride, BN, S, LB, HB, G, KQUANT, HAS_MIN, PACKED_MIN, FULL,
    )  # fmt: skip


@triton.jit(do_not_specialize=NO_SPECIALIZE_MOE)
def moe_streamk_rows_kernel(
    x_ptr, xf_ptr, y_ptr, part_ptr, cnt_ptr, ids_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    N, n_chunks, KS, U, P, MAXC, TILES, x_div, xw_stride, xf_stride, y_stride,
    bias_ptr, bias_stride, code_stride, grp_stride, sb_stride, zero,
    LB: tl.constexpr, HB: tl.constexpr, G: tl.constexpr, OFF: tl.constexpr,
    KQUANT: tl.constexpr, HAS_MIN: tl.constexpr, PACKED_MIN: tl.constexpr, CB: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr, ASM: tl.constexpr, FULL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """y[s, r] = W_ids[s][r] . x[s // x_div] (+ bias[ids[s], r]) for every slot s and row
    r < N, BN = 32 x num_warps rows a tile, the units (global tile, ks) of
    `qgemv_streamk_rows_kernel`. The bias joins the partial sum of a tile's first program."""
    pdl_wait(PDL)
    u0, u1, tile, ks = _run(U, P, KS, False)
    planes = (codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr)
    strides = (code_stride, grp_stride, sb_stride)
    nxt = _expert_unit(
        ids_ptr, *planes, tile, ks, u0 < u1, TILES, N, n_chunks, *strides,
        BN, S, LB, HB, G, KQUANT, HAS_MIN, PACKED_MIN, FULL,
    )  # fmt: skip
    acc = tl.zeros([BN], dtype=tl.float32)
    for u in range(u0, u1):
        cur = nxt
        tile_n, ks_n, wrap = _next_unit(tile, ks, KS)
        nxt = _expert_unit(
            ids_ptr, *planes, tile_n, ks_n, u + 1 < u1, TILES, N, n_chunks, *strides,
            BN, S, LB, HB, G, KQUANT, HAS_MIN, PACKED_MIN, FULL,
        )  # fmt: skip
        slot = tile // TILES
        xrow = (slot // x_div).to(tl.int64)
        acc += _rows_int_step(
            *cur, x_ptr + xrow * xw_stride, xf_ptr + xrow * xf_stride, ks * S, n_chunks, S,
            FULL, LB, HB, G, OFF, KQUANT, HAS_MIN, PACKED_MIN, CB, ASM,
        )  # fmt: skip
        end = wrap | (u + 1 == u1)
        if end:
            rows = (tile % TILES) * BN + tl.arange(0, BN)
            first, count = _tile_programs(tile, KS, U, P)
            if HAS_BIAS:
                e = tl.load(ids_ptr + slot).to(tl.int64)
                b = tl.load(bias_ptr + e * bias_stride + rows, mask=rows < N, other=0)
                acc += tl.where(tl.program_id(0) == first, b.to(tl.float32), 0.0)
            _split_k_store(
                acc, y_ptr + slot.to(tl.int64) * y_stride + rows, rows < N, part_ptr,
                tile.to(tl.int64) * MAXC * BN + tl.arange(0, BN), BN, cnt_ptr + tile,
                tl.program_id(0) - first, count,
            )  # fmt: skip
        acc = tl.where(end, 0.0, acc)
        tile, ks = tile_n, ks_n
