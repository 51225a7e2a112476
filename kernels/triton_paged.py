"""Paged KV ops on CUDA through Triton: the fused KV write and paged attention.

Same signatures as the references in kernels/paged.py (the truth they are tested against). The
attention kernels read the step's tensor metadata (PagedMeta.tensors, a TensorMeta built once
per step by the runner):

    block_tables [B, max_blocks] int32   the blocks of each sequence, in order
    seq_lens     [B] int32               context length, new tokens included (written first)
    q_start_loc  [B + 1] int32           first row of each sequence's queries in q [T, H, D]
    max_q_len, max_seq_len               host ints: the grid and the split-K sizing

so a decode step launches without host lists (CUDA-graph friendly: a captured step replays with
new values in the same tensors). A meta without block_tables goes to the reference.

Decode (every sequence one query) is flash-decoding: the context is cut into splits, one program
per (sequence, KV head, split) over all G = H / KV query heads of that KV head (GQA: each K/V tile
is read once for the group), and the last split of each to finish merges them (one launch a
layer; a short context takes fewer splits than the grid has, one split writes its output itself).
Prefill is one program per (query tile, sequence, head) walking the sequence's pages causally.

FP8 caches are read and written as uint8 (triton_paged_kernels): the write encodes with integers,
the attention decodes by the conversion instruction where the GPU has one (sm_89+) and with
integers before, so any device of compute capability >= 8.0 runs them. The decode kernel is in
triton_decode_kernels, the KV write and prefill kernels in triton_paged_kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from hetero.kernels.paged import FP8, paged_attention_ref
from hetero.kernels.paged_sinks import paged_attention_sinks_ref
from hetero.kernels.pdl import pdl_launch
from hetero.kernels.registry import register
from hetero.kernels.triton_fused import rope_tables
from hetero.kernels.triton_qmatmul import _counters, _sm_count, triton_supported

DECODE_BN = 32  # keys a decode loop step
MIN_SPLIT = 32  # fewest keys a decode split takes (each sequence's own, in the kernel)
MERGE_SPLITS = 8  # splits a merge loads at once
DECODE_STAGES = 1  # the decode loop's software pipeline (Triton's num_stages; 1: none)
_CTAS_PER_SM = 2
PREFILL_BM, PREFILL_BN = 64, 32


def _kernels() -> Any:
    from hetero.kernels import triton_paged_kernels  # imports triton: first use only

    return triton_paged_kernels


def _decode_kernels() -> Any:
    from hetero.kernels import triton_decode_kernels  # imports triton: first use only

    return triton_decode_kernels


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches as uint8 (the kernels convert e4m3 themselves); others as they are."""
    if cache.stride(-1) != 1 or cache.stride(-2) != cache.shape[-1]:
        raise ValueError("KV cache rows must be contiguous [slots, KV, D]")
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def _cache_ptrs(k_cache, v_cache, k_scale, v_scale) -> tuple[list, bool]:
    """([k, v, their scales] as the kernels take them: fp8 as uint8, a 16-bit cache's scales
    unread (its own tensors passed), whether they are fp8)."""
    kc, vc = _bits(k_cache), _bits(v_cache)
    fp8 = k_cache.dtype == FP8
    return [kc, vc, k_scale if fp8 else kc, v_scale if fp8 else vc], fp8


@register("kv_write", "triton", priority=10, supports=triton_supported)
def kv_write_triton(k_cache, v_cache, k_scale, v_scale, slots, k, v) -> None:
    """Quantize k, v [T, KV, D] and scatter them to `slots` [T] in one launch (slot < 0: skip)."""
    t, kv, d = k.shape
    if t == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    caches, fp8 = _cache_ptrs(k_cache, v_cache, k_scale, v_scale)
    _kernels().kv_write_kernel[(t, kv)](
        k, v, *caches, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV=kv, D=d, BD=_pow2(d), FP8=fp8, **pdl_launch(k),
    )  # fmt: skip


@register("rope_kv_write", "triton", priority=10, supports=triton_supported)
def rope_kv_write_triton(q, k, v, cos, sin, style: str, k_cache, v_cache, k_scale, v_scale, slots):
    """rope_kv_write_ref's contract in one launch: q [T, H, D], k and v [T, KV, D] with any row
    and head strides (views of one q|k|v matmul output), unit stride along D; cos, sin
    [T, R]. Returns the rotated q [T, H, D]."""
    cos, sin = rope_tables(cos, sin, style)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    t, h, d = q.shape
    kv = k.shape[1]
    r = cos.shape[-1]
    qo = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return qo
    ko = torch.empty(t, kv, d, dtype=k.dtype, device=k.device)
    caches, fp8 = _cache_ptrs(k_cache, v_cache, k_scale, v_scale)
    _kernels().rope_kv_write_kernel[(t, h + kv)](
        q, k, v, cos, sin, qo, ko, *caches, slots, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), h, r,
        KV=kv, D=d, BD=_pow2(d), BR=_pow2(r), NEOX=style == "neox", FP8=fp8, **pdl_launch(q),
    )  # fmt: skip
    return qo


def decode_splits(batch: int, kv: int, max_len: int, sm_count: int) -> int:
    """The decode grid's splits: enough programs to fill the SMs, each split at least MIN_SPLIT
    of the longest context long. Depends on shapes and max_len only, so a CUDA graph (max_len =
    its longest context) keeps one grid; each sequence takes as many of them as its own length
    gives (at least MIN_SPLIT keys a split), the rest return at once."""
    want = max(1, (_CTAS_PER_SM * sm_count) // max(1, batch * kv))
    return max(1, min(want, -(-max_len // MIN_SPLIT)))


@functools.cache
def hw_fp8(device: torch.device) -> bool:
    """Whether the attention kernels decode fp8 codes by the GPU's conversion instruction (CUDA
    sm_89+; under the interpreter too, which converts them itself), else with integers."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _cache_args(
    q, k_cache, v_cache, k_scale, v_scale, scaled: bool = False
) -> tuple[list, dict[str, Any]]:
    """The caches as the attention kernels take them (fp8 as uint8, a 16-bit cache's scales
    unused) and the constexprs of their dtypes: FP8, HW, DT, IEEE. scaled: the prefill
    kernels' tiles, scaled themselves in q's dtype (the decode kernel's fp8 tiles are float16
    codes whose scales meet the scores: `_kv_tile`)."""
    caches, fp8 = _cache_ptrs(k_cache, v_cache, k_scale, v_scale)
    consts = dict(
        FP8=fp8, HW=fp8 and hw_fp8(q.device),
        DT=_kernels().tile_dtype(q.dtype, fp8 and not scaled), IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return caches, consts


def paged_decode(
    q, k_cache, v_cache, k_scale, v_scale, meta, scale, n_splits=None, window=0, sinks=None,
    merge=True, xq=None, rope=None,
):  # fmt: skip
    """q [B, H, D], one query a sequence -> [B, H, D]. n_splits: tests force it; by default
    decode_splits picks it from the shapes and meta.max_seq_len (the window, when shorter).
    window, sinks: kernels/paged_sinks.py. One launch: with several splits the last of each
    KV head's merges them (merge=False: a reduce kernel after, as the benchmarks compare).
    xq (words, floats, layout): the output also quantized into them for an integer GEMV, by
    the programs that write it. rope (k, v, cos, sin, style, slots): q and the new k not yet
    rotated, k and v not yet stored; the kernel does both (`rope_attention_triton`)."""
    b, h, d = q.shape
    kv = k_cache.shape[1]
    out = torch.empty_like(q)
    if b == 0:
        return out
    longest = max(1, int(meta.max_seq_len) if not window else min(window, int(meta.max_seq_len)))
    n = n_splits or decode_splits(b, kv, longest, _sm_count(q.device))
    caches, consts = _cache_args(q, k_cache, v_cache, k_scale, v_scale)
    part_o = torch.empty(b, h, n, d, dtype=torch.float32, device=q.device)  # (one split: unused)
    part_ml = torch.empty(b, h, n, 2, dtype=torch.float32, device=q.device)
    cnt = _counters(q.device, b * kv)
    bt = meta.block_tables
    kern = _decode_kernels()
    sink_ptr = q if sinks is None else sinks
    words, floats = (xq[0], xq[1]) if xq is not None else (cnt, part_o)
    if xq is not None:
        if not merge:
            raise ValueError("the output's quantization is the merging programs' (merge=True)")
        lay = xq[2]
        consts.update(XQ=True, LB=lay.low_bits, GU=lay.unit, REGROUP=lay.regroup)
    rope_args = [q, q, q, q, q, q, cnt, 0, 0, 0, 0, 0, 0]  # (unread without ROPE)
    if rope is not None:
        k, v, cos, sin, style, slots = rope
        cos, sin = rope_tables(cos, sin, style)
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
        qo, ko = torch.empty(b, h, d, dtype=q.dtype, device=q.device), torch.empty_like(k)
        rope_args = [k, v, cos, sin, qo, ko, slots, k.stride(0), k.stride(1), v.stride(0),
                     v.stride(1), cos.stride(0), cos.shape[-1]]  # fmt: skip
        consts.update(ROPE=True, BR=_pow2(cos.shape[-1]), NEOX=style == "neox")
    kern.decode_split_kernel[(b, kv, n)](
        q, *caches, bt, meta.seq_lens, part_o, part_ml, out, sink_ptr, cnt, words, floats,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0), n,
        MIN_SPLIT, window, *rope_args,
        H=h, KV=kv, G=h // kv, BG=_pow2(h // kv, 16), D=d, BD=_pow2(d),
        BS=meta.block_size, BN=DECODE_BN, SINKS=sinks is not None, MERGE=merge,
        BH=_pow2(h // kv), MC=MERGE_SPLITS, num_stages=DECODE_STAGES, **consts,
        **pdl_launch(q),
    )  # fmt: skip
    if n > 1 and not merge:
        kern.decode_reduce_kernel[(b, h)](
            part_o, part_ml, out, sink_ptr, meta.seq_lens, out.stride(0), out.stride(1), n,
            MIN_SPLIT, window, H=h, D=d, BD=_pow2(d), BN=DECODE_BN, MC=MERGE_SPLITS,
            SINKS=sinks is not None, **pdl_launch(q),
        )  # fmt: skip
    return out


def xquant_fuses(h: int, kv: int, d: int, layout) -> bool:
    """Whether the decode kernel quantizes its output in `layout`: a KV head's G * D output
    elements must be whole chunks (a power of two, for the kernel's tiles)."""
    span = h // kv * d
    return span & (span - 1) == 0 and span % max(layout.chunk, 32) == 0


@register("rope_attention", "triton", priority=10, supports=triton_supported)
def rope_attention_triton(
    q, k, v, cos, sin, style, k_cache, v_cache, k_scale, v_scale, slots, meta, scale, layout=None
):  # fmt: skip
    """rope_attention_ref's contract in one launch where the step is a decode step (every
    sequence one query; else None: the caller rotates, stores and attends in launches of their
    own): the decode kernel rotates q and the new k, stores k and v, attends, and with a layout
    (16-bit q whose head groups are whole chunks of it) quantizes its output too; words and
    floats None where it does not. Rows that may be one sequence's (`shared`: a graph step's
    guesses or prompt chunk) are declined: a row reads keys other rows store, and programs of
    one launch are not ordered."""
    tm = getattr(meta, "tensors", None)
    b, h, d = q.shape
    if tm is None or tm.tiles is not None or tm.max_q_len != 1 or b != tm.seq_lens.shape[0]:
        return None
    if tm.shared:
        return None
    xq = None
    if layout is not None and q.dtype != torch.float32:
        if xquant_fuses(h, k_cache.shape[1], d, layout):
            from hetero.kernels.xquant import xquant_buffers

            xq = (*xquant_buffers(b, h * d, layout, q.device), layout)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, tm, scale, xq=xq,
        rope=(k, v, cos, sin, style, slots),
    )  # fmt: skip
    return (out, None, None) if xq is None else (out, xq[0], xq[1])


def paged_prefill(
    q, k_cache, v_cache, k_scale, v_scale, meta, scale, bm=None, bn=None, window=0, sinks=None
):  # fmt: skip
    """q [T, H, D], sequences' new queries back to back (any lengths) -> [T, H, D]."""
    t, h, d = q.shape
    kv = k_cache.shape[1]
    out = torch.empty_like(q)
    b = meta.seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    bm, bn = bm or PREFILL_BM, bn or PREFILL_BN
    caches, consts = _cache_args(q, k_cache, v_cache, k_scale, v_scale, scaled=True)
    bt = meta.block_tables
    grid = (-(-int(meta.max_q_len) // bm), b, h)
    _kernels().prefill_kernel[grid](
        q, *caches, bt, meta.seq_lens, meta.q_start_loc, out, scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), bt.stride(0), window, q if sinks is None else sinks,
        KV=kv, G=h // kv, D=d, BD=_pow2(d), BS=meta.block_size, BM=bm, BN=bn,
        SINKS=sinks is not None, **consts,
    )  # fmt: skip
    return out


def paged_rows(
    q, k_cache, v_cache, k_scale, v_scale, meta, scale, bn=None, window=0, sinks=None
):  # fmt: skip
    """q [B, H, D], one query a row, where meta.tiles says which rows attend as tiles of one
    prompt chunk (engine/paged_meta.RowTiles): flash-decoding for the others (each over its own
    context), then one program per (tile, head) for the tiled rows. -> [B, H, D]."""
    b, h, d = q.shape
    tiles = meta.tiles
    rows_alone = dataclasses.replace(meta, seq_lens=tiles.decode_lens)
    out = paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, rows_alone, scale, window=window, sinks=sinks
    )
    if b == 0:
        return out
    caches, consts = _cache_args(q, k_cache, v_cache, k_scale, v_scale, scaled=True)
    kv = k_cache.shape[1]
    bt = meta.block_tables
    _kernels().row_tile_kernel[(-(-b // tiles.rows), h)](
        q, *caches, bt, tiles.tile_lens, out, scale, b, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), bt.stride(0), window, q if sinks is None else sinks,
        KV=kv, G=h // kv, D=d, BD=_pow2(d), BS=meta.block_size, BM=tiles.rows,
        BN=bn or PREFILL_BN, SINKS=sinks is not None, **consts,
    )  # fmt: skip
    return out


def _attention(q, k_cache, v_cache, k_scale, v_scale, tm, scale, window=0, sinks=None):
    """The kernel for a step's shape: row tiles, decode (one query a sequence) or prefill."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    extra = dict(window=window, sinks=sinks)
    if tm.tiles is not None:
        return paged_rows(q, k_cache, v_cache, k_scale, v_scale, tm, scale, **extra)
    if tm.max_q_len == 1 and q.shape[0] == tm.seq_lens.shape[0]:
        return paged_decode(q, k_cache, v_cache, k_scale, v_scale, tm, scale, **extra)
    return paged_prefill(q, k_cache, v_cache, k_scale, v_scale, tm, scale, **extra)


@register("paged_attention", "triton", priority=10, supports=triton_supported)
def paged_attention_triton(q, k_cache, v_cache, k_scale, v_scale, meta, scale: float):
    """paged_attention_ref's contract, from meta.tensors (a TensorMeta; the reference without)."""
    tm = getattr(meta, "tensors", None)
    if tm is None:
        return paged_attention_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale)
    return _attention(q, k_cache, v_cache, k_scale, v_scale, tm, scale)


@register("paged_attention_sinks", "triton", priority=10, supports=triton_supported)
def paged_attention_sinks_triton(
    q, k_cache, v_cache, k_scale, v_scale, meta, scale: float, window: int, sinks
):  # fmt: skip
    """paged_attention_sinks_ref's contract (kernels/paged_sinks.py): the same kernels, their
    key loops starting at the window and the sink in each softmax's sum."""
    tm = getattr(meta, "tensors", None)
    if tm is None:
        return paged_attention_sinks_ref(
            q, k_cache, v_cache, k_scale, v_scale, meta, scale, window, sinks
        )
    sinks = None if sinks is None else sinks.float().contiguous()
    return _attention(q, k_cache, v_cache, k_scale, v_scale, tm, scale, window, sinks)
