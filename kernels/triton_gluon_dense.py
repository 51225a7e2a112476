"""A dense linear of 4- and 6-bit codes on the tensor cores for a batch of up to 64 tokens, each
weight decoded once a program where the tensor cores read it (Gluon, as triton_gluon_moe).

The MoE blocks kernel keeps x's fragments in registers, a whole chunk of 32 elements a slot
column a thread, which bounds a block to 16 slots: as a dense linear at 64 tokens its four
blocks decode the weight four times (`gluon_dense`: slower than the Triton tile kernel there).
Here x goes through shared memory instead: a step's [BT, 128] tile is stored once a program and
each warp reads its B fragments from there (ldmatrix), so one program takes BT = 32 or 64
tokens and decodes its rows' codes once for all of them. The weights' side is the MoE kernel's
(its A fragments, code words loaded whole by the threads that hold them; its helpers).

The A fragments' k-step (s_hi, w) takes column kk = 8 p4 + 2t + h from element
16h + 8 s_hi + 4 p4 + w of chunk t (triton_gluon_moe's docstring), so x enters permuted the
same way: `permute_x` writes x [T, K] as xp [K / 128, 8, T, 16], k-step ks = 4 s_hi + w of step
s holding, for token n, columns kk in order (one torch copy of x a call). A step's tile
xp[s, :, tokens, :] is then 8 contiguous [BT, 16] slabs, stored to shared memory as loaded, and
B of k-step ks is slab ks transposed.

The high plane of Q6_K as the dense kernels keep it ("bytes", repack.high_bit_places): the 2
high bits of fields f and f + 4 of word c lie in high word c / 2 of the chunk at bits b and
b + 16, b = 8 (f / 2) + 4 (c % 2) + 2 (f % 2): one shift and a mask put the pair's next to its
low codes, as in the MoE kernel's "fields" arrangement.

On sm_90 `wg` runs the same program on Hopper's warpgroup MMA: a warpgroup's A fragments are
mma.sync's, four warps of 16 rows (the compiler asserts the conversion trivial), and the
tensor cores read B from the shared tile themselves (no ldmatrix; one wgmma a k-step where
mma.sync takes BT / 8), each wgmma waited for before the next k-step's decode.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from hetero.kernels.triton_gluon_moe import (
    _a_fragment,
    _neg_bias,
    _range3,
    _scale_loads,
    _scale_pairs,
    _shl,
    _words4,
    tile_layouts,
)

STEP = 128  # codes of K a loop step: 4 chunks, one a thread of a lane quad


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K a multiple of 128) -> xp [K / 128, 8, T, 16]: xp[s, 4 s_hi + w, n, 8 p4 +
    2 t + h] = x[n, 128 s + 32 t + 16 h + 8 s_hi + 4 p4 + w] (the module docstring)."""
    t, k = x.shape
    v = x.reshape(t, k // STEP, 4, 2, 2, 2, 4)  # n, s, t, h, s_hi, p4, w
    return v.permute(1, 4, 6, 0, 5, 2, 3).reshape(k // STEP, 8, t, 16).contiguous()


@functools.cache
def dense_layouts(warps: int, m_tiles: int, bt: int) -> tuple:
    """(W, H, S, X, X2) layouts of a step's loads, BN = 16 warps m_tiles rows: W [BN, 4, 4] code
    words (row, chunk t, word) and S [BN, 4] as the MoE kernel's (lane l: chunk l % 4 of rows
    l / 4 and + 8), H [BN, 4, 2] the chunks' two high words beside them, X [8, BT, 16] x's
    tile in 16-byte vectors (a warp: 16 tokens x 2 vectors of one k-step), X2 the same tile as
    [8 BT, 16] (its cp.async copies)."""
    w, s, _ = tile_layouts(warps, m_tiles, 8)
    h = gl.DistributedLinearLayout(
        [w.reg_bases[0], *w.reg_bases[2:]], w.lane_bases, w.warp_bases, [], [*w.shape[:2], 2]
    )  # (W's registers but its second word bit)
    x = gl.BlockedLayout([1, 1, 8], [1, 16, 2], [warps, 1, 1], [2, 1, 0])
    x2 = gl.BlockedLayout([1, 8], [16, 2], [warps, 1], [1, 0])
    return w, h, s, x, x2


@gluon.jit
def _x_tile_async(buf, xp_ptr, step, T, t0, BT: gl.constexpr, X2_L: gl.constexpr):
    """Step `step`'s x tile [8 BT, 16] (k-step ks's tokens t0 .. t0 + BT at rows ks BT ..) into
    shared memory `buf` by cp.async, 16 bytes a copy, as one commit group; tokens past T
    zero-filled."""
    r = gl.arange(0, 8 * BT, layout=gl.SliceLayout(1, X2_L))
    kk = gl.arange(0, 16, layout=gl.SliceLayout(0, X2_L))
    tok = t0 + r % BT
    rows = step * (8 * T) + (r // BT) * T + tok
    ptrs = xp_ptr + rows.to(gl.int64)[:, None] * 16 + kk[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, (tok < T)[:, None] & (kk < 16)[None, :])
    async_copy.commit_group()


@gluon.jit
def _step_mma(
    acc, buf, w0, w1, w2, w3, h0, h1, a2, nb2, neg_bias,
    HB: gl.constexpr, FP16: gl.constexpr, BT: gl.constexpr, A_L: gl.constexpr,
    B_L: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    """acc + the step's 8 k-steps: the A fragments decoded from the chunks' words (h0, h1: the
    high words, HB 2), B from x's tile in shared memory `buf` [8 BT, 16] (WG: wgmma reads it
    there; else ldmatrix into mma.sync's fragments)."""
    MAGIC: gl.constexpr = 0x64006400 if FP16 else 0x43004300
    for s_hi in gl.static_range(2):
        for w in gl.static_range(4):
            if w == 0:
                ww = w0
            elif w == 1:
                ww = w1
            elif w == 2:
                ww = w2
            else:
                ww = w3
            q0 = ((ww >> (8 * s_hi)) & 0x000F000F) | MAGIC
            q1 = ((ww >> (8 * s_hi + 4)) & 0x000F000F) | MAGIC
            if HB > 0:  # the pair's high bits (bits b, b + 16 of word w / 2) to bits 4, 5
                hh = h1 if w >= 2 else h0
                q0 = q0 | (_shl(hh, 4 - 8 * s_hi - 4 * (w % 2)) & 0x00300030)
                q1 = q1 | (_shl(hh, 2 - 8 * s_hi - 4 * (w % 2)) & 0x00300030)
            wa = _a_fragment(q0, q1, a2, nb2, neg_bias, FP16, A_L)
            xb = buf.slice((4 * s_hi + w) * BT, BT).permute((1, 0))
            if WG:
                acc = warpgroup_mma(wa, xb, acc)
            else:
                acc = mma_v2(wa, xb.load(B_L), acc)
    return acc


@gluon.jit
def _step_loads(
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr, c0, w_off, h_off, g_off, sb_off,
    HB: gl.constexpr, G: gl.constexpr, KQUANT: gl.constexpr, HAS_MIN: gl.constexpr,
):  # fmt: skip
    """Step c0's weight loads, nothing computed from them: (code words [BN, 4, 4], high words
    [BN, 4, 2] (HB 0: the code words again, not read), and `_scale_loads`' five fields)."""
    words = gl.load(codes_ptr + c0 * 4 + w_off)
    hw = words
    if HB > 0:
        hw = gl.load(high_ptr + c0 * 2 + h_off)
    sc, sc2, d, dmin, mn = _scale_loads(
        scale_ptr, min_ptr, d_ptr, dmin_ptr, c0, g_off, sb_off, G, KQUANT, HAS_MIN
    )
    return words, hw, sc, sc2, d, dmin, mn


@gluon.jit
def _high2(hw, HB: gl.constexpr, S_L: gl.constexpr):
    """[BN, 4, 2] high words -> the chunks' two [BN, 4] (HB 0: hw, not read, twice)."""
    h0 = hw
    h1 = hw
    if HB > 0:
        h0, h1 = gl.split(hw)
        h0 = gl.convert_layout(h0, S_L, assert_trivial=True)
        h1 = gl.convert_layout(h1, S_L, assert_trivial=True)
    return h0, h1


@gluon.jit
def dense_mm_mma_kernel(
    xp_ptr, y_ptr, part_ptr, cnt_ptr,
    codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr,
    T, N, n_chunks, chunks_per_split, y_stride,
    code_stride, grp_stride, sb_stride,
    HB: gl.constexpr, G: gl.constexpr, OFF: gl.constexpr, KQUANT: gl.constexpr,
    HAS_MIN: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, WARPS: gl.constexpr,
    PIPE: gl.constexpr, WG: gl.constexpr, SPLITK: gl.constexpr,
    W_L: gl.constexpr, H_L: gl.constexpr, S_L: gl.constexpr, X_L: gl.constexpr,
    X2_L: gl.constexpr,
):  # fmt: skip
    """y[tokens, rows] = x @ W^T for program (row tile of BN, token tile of BT): the token
    tiles of one row tile are neighbouring programs (the tiles after the first read the rows'
    codes from L2). xp: `permute_x` of x; n_chunks a multiple of 4. Rows past N read row N - 1
    and tokens past T read zeros; neither is stored.

    PIPE: the next step's code words and scale fields load into registers, and its x tile by
    cp.async into the other of two shared buffers, before this step's arithmetic (a step's
    loads in flight while the last is decoded and multiplied); else a step loads, stores its
    tile, then computes.

    program_id(1) takes chunks_per_split chunks of K (a multiple of 4). SPLITK (several): each
    program stores its float32 partial and bumps its tile's counter; the last of a tile's to
    arrive adds them (`_split_sum`), writes y and resets the counter for the next launch (as the
    Triton kernels' `_split_k_store`): weights of few row tiles (o, down at 64 tokens: 32 tiles
    of 128 rows) still fill the SMs."""
    if WG:  # Hopper's warpgroup MMA: A from the registers (mma.sync's fragments a warp), B
        # from shared memory in its swizzled layout
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BT, 16]
        )
        SMEM: gl.constexpr = gl.NVMMASharedLayout(32, 16, 2)
    else:
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
        )
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, [1, 0])  # rows of 32 B, 4 a phase
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    HT: gl.constexpr = xp_ptr.dtype.element_ty
    FP16: gl.constexpr = HT == gl.float16
    GC: gl.constexpr = 32 // G  # groups a chunk

    n_t = gl.cdiv(T, BT)
    pid_n = gl.program_id(0) // n_t
    pid_t = gl.program_id(0) % n_t
    k0 = gl.program_id(1) * chunks_per_split
    k1 = gl.minimum(k0 + chunks_per_split, n_chunks)
    # code words [BN, 4, 4] and high words [BN, 4, 2]: row r (clamped), chunk t, word
    r3 = gl.minimum(pid_n * BN + _range3(BN, 0, W_L), N - 1)
    w_off = r3 * code_stride + _range3(4, 1, W_L) * 4 + _range3(4, 2, W_L)
    r3h = gl.minimum(pid_n * BN + _range3(BN, 0, H_L), N - 1)
    h_off = r3h * (code_stride // 2) + _range3(4, 1, H_L) * 2 + _range3(2, 2, H_L)
    # scales [BN, 4]: row r, chunk t (its first group)
    r2 = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, S_L)), N - 1)
    t2 = gl.arange(0, 4, layout=gl.SliceLayout(0, S_L))
    g_off = r2[:, None] * grp_stride + GC * t2[None, :]
    sb_off = r2 * sb_stride
    planes = (codes_ptr, high_ptr, scale_ptr, min_ptr, d_ptr, dmin_ptr)
    offs = (w_off, h_off, g_off, sb_off)
    neg_bias = _neg_bias(OFF, FP16, BN, S_L)
    acc = gl.zeros([BN, BT], gl.float32, MMA)
    if PIPE:
        x_smem = gl.allocate_shared_memory(HT, [2, 8 * BT, 16], SMEM)
        _x_tile_async(x_smem.index(0), xp_ptr, k0 // 4, T, pid_t * BT, BT, X2_L)
        words, hw, sc, sc2, d, dmin, mn = _step_loads(*planes, k0, *offs, HB, G, KQUANT, HAS_MIN)
        for c0 in range(k0, k1, 4):
            nxt = gl.minimum(c0 + 4, k1 - 4)  # (the last step loads itself again, unused)
            buf = ((c0 - k0) // 4 + 1) % 2
            _x_tile_async(x_smem.index(buf), xp_ptr, nxt // 4, T, pid_t * BT, BT, X2_L)
            words_n, hw_n, sc_n, sc2_n, d_n, dmin_n, mn_n = _step_loads(
                *planes, nxt, *offs, HB, G, KQUANT, HAS_MIN
            )
            a2, nb2 = _scale_pairs(sc, sc2, d, dmin, mn, G, KQUANT, HAS_MIN, FP16, BN, S_L)
            w0, w1, w2, w3 = _words4(words, S_L)
            h0, h1 = _high2(hw, HB, S_L)
            async_copy.wait_group(1)  # this step's tile is in (the next one may not be)
            gl.thread_barrier()
            if WG:
                fence_async_shared()  # (the tile's writes seen by the tensor cores' reads)
            acc = _step_mma(
                acc, x_smem.index(((c0 - k0) // 4) % 2), w0, w1, w2, w3, h0, h1, a2, nb2,
                neg_bias, HB, FP16, BT, A_L, B_L, WG,
            )  # fmt: skip
            gl.thread_barrier()  # every warp done with the buffer the step after next fills
            words, hw = words_n, hw_n
            sc, sc2, d, dmin, mn = sc_n, sc2_n, d_n, dmin_n, mn_n
        async_copy.wait_group(0)
    else:
        # x's tile [8, BT, 16]: k-step, token, column
        tok = pid_t * BT + _range3(BT, 1, X_L)
        x_off = _range3(8, 0, X_L) * (T * 16) + tok * 16 + _range3(16, 2, X_L)
        x_mask = (tok < T) & (_range3(16, 2, X_L) < 16)
        x_smem = gl.allocate_shared_memory(HT, [8 * BT, 16], SMEM)
        for c0 in range(k0, k1, 4):
            xs = gl.load(xp_ptr + (c0 // 4) * (8 * T * 16) + x_off, mask=x_mask, other=0.0)
            words, hw, sc, sc2, d, dmin, mn = _step_loads(
                *planes, c0, *offs, HB, G, KQUANT, HAS_MIN
            )
            a2, nb2 = _scale_pairs(sc, sc2, d, dmin, mn, G, KQUANT, HAS_MIN, FP16, BN, S_L)
            w0, w1, w2, w3 = _words4(words, S_L)
            h0, h1 = _high2(hw, HB, S_L)
            gl.thread_barrier()  # every warp done reading the last step's tile
            x_smem.store(gl.reshape(xs, [8 * BT, 16]))
            gl.thread_barrier()
            if WG:
                fence_async_shared()
            acc = _step_mma(
                acc, x_smem, w0, w1, w2, w3, h0, h1, a2, nb2, neg_bias, HB, FP16, BT, A_L, B_L, WG
            )
    r_o = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    t_o = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    dst = y_ptr + t_o.to(gl.int64)[None, :] * y_stride + r_o[:, None]
    mask = (r_o < N)[:, None] & (t_o < T)[None, :]
    if SPLITK:
        poff = t_o[None, :] * N + r_o[:, None]
        gl.store(part_ptr + gl.program_id(1) * (T * N) + poff, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial stored before the counter moves
        arrived = gl.atomic_add(cnt_ptr + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == gl.num_programs(1) - 1:
            _split_sum(part_ptr, y_ptr, pid_n, pid_t, T, N, y_stride, BN, BT, WARPS)
            gl.atomic_xchg(cnt_ptr + gl.program_id(0), 0, sem="relaxed", scope="gpu")
    else:
        gl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _split_sum(
    part_ptr, y_ptr, pid_n, pid_t, T, N, y_stride,
    BN: gl.constexpr, BT: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """y's tile = the splits' float32 partials (part [split, T, N]) added in split order, by the
    last split to arrive (the sum the same whatever the order of arrival). A flat layout, rows
    fastest: the partials and y read and written in coalesced runs of rows, and nothing of the
    MMA layout's registers kept (the partial sums' layout set the kernel's registers before)."""
    L: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    idx = gl.arange(0, BN * BT, layout=L)
    r = pid_n * BN + idx % BN
    tok = pid_t * BT + idx // BN
    m = (r < N) & (tok < T)
    off = tok * N + r
    total = gl.zeros([BN * BT], gl.float32, L)
    for s in range(gl.num_programs(1)):
        total += gl.load(part_ptr + s * (T * N) + off, mask=m, other=0.0, cache_modifier=".cg")
    gl.store(y_ptr + tok.to(gl.int64) * y_stride + r, total.to(y_ptr.dtype.element_ty), mask=m)


def dense_takes(spec, high_layout: str, dtype: torch.dtype, k: int, bt: int) -> bool:
    """Whether the kernel takes such a linear: 4-bit codes whose group is a chunk (Q4_K, Q4_0,
    Q4_1), or Q6_K with the dense kernels' "bytes" high plane; 16-bit x; K in steps of 128;
    16, 32 or 64 tokens a program."""
    q4 = spec.group == 32 and not spec.high_bits
    q6 = spec.group == 16 and spec.high_bits == 2 and spec.kquant and high_layout == "bytes"
    return (
        spec.low_bits == 4 and (q4 or q6) and not spec.codebook and not spec.packed_min
        and dtype in (torch.bfloat16, torch.float16) and k % STEP == 0 and bt in (16, 32, 64)
    )  # fmt: skip


def dense_mm(
    x: torch.Tensor, pw, bn: int = 128, bt: int = 64, warps: int = 4, pipe: bool = False,
    wg: bool = False, split: int = 0, ctas: int = 2,
) -> torch.Tensor:  # fmt: skip
    """y [T, N] = x @ W^T (x [T, K] 16-bit, W a PackedWeight the kernel takes: `dense_takes`),
    programs of bn rows (16 warps m-tiles) x bt tokens; pipe: the next step loaded ahead; wg:
    Hopper's warpgroup MMA (sm_90 only; warps a multiple of 4); split: programs along K (0:
    enough for `ctas` programs an SM, at least 4 steps of 128 codes each)."""
    from hetero.kernels.triton_qmatmul import _counters, _plane_args, _sm_count

    t, k = x.shape
    n = pw.shape[0]
    if not dense_takes(pw.spec, pw.high_layout, x.dtype, k, bt):
        raise ValueError(f"the dense Gluon kernel does not take {pw.ggml_type.name} at K {k}")
    if bn % (16 * warps) or (bn // (16 * warps)) & (bn // (16 * warps) - 1):
        raise ValueError(f"{bn} rows a program is not 16 x {warps} warps x a power of two")
    if wg and warps % 4:
        raise ValueError(f"the warpgroup MMA takes warps in fours, not {warps}")
    xp = permute_x(x)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    args, _ = _plane_args(pw)
    spec = pw.spec
    w_l, h_l, s_l, x_l, x2_l = dense_layouts(warps, bn // (16 * warps), bt)
    tiles, steps = -(-n // bn) * -(-t // bt), k // STEP
    if not split:  # enough programs for the SMs, no split under 4 steps (512 codes)
        split = max(1, min(-(-ctas * _sm_count(x.device) // tiles), steps // 4))
    per = -(-steps // split)  # steps a split; no empty split
    split = -(-steps // per)
    part = y if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, tiles)
    dense_mm_mma_kernel[(tiles, split)](
        xp, y, part, cnt, *args[:6], t, n, k // 32, 4 * per, y.stride(0), *args[6:9],
        HB=spec.high_bits, G=spec.group, OFF=spec.offset, KQUANT=spec.kquant,
        HAS_MIN=spec.has_min, BN=bn, BT=bt, WARPS=warps, PIPE=pipe, WG=wg, SPLITK=split > 1,
        W_L=w_l, H_L=h_l, S_L=s_l, X_L=x_l, X2_L=x2_l, num_warps=warps,
    )  # fmt: skip
    return y
