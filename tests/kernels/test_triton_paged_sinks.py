"""Paged attention with a sliding window and sinks (gpt-oss): the Triton kernels against the
reference (kernels/paged_sinks.py), and the reference against a plain softmax.

The kernels of tests/kernels/test_triton_paged.py, their key loops started at the window and
the sink logit in each softmax's sum: decode with forced splits (the window cut into them),
prefill after a cached prefix (query tiles whose rows' windows start in different key tiles),
the row tiles of a CUDA-graph step, windows of 1, 5 and 37 keys and none, with and without
sinks, fp8 and fp16 caches. Without CUDA under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from hetero.execution.paged_meta import RowTiles, split_row_tiles, tensor_meta
from hetero.execution.runner import PagedMeta
from hetero.kernels import triton_paged as tp
from hetero.kernels.paged import kv_read, paged_attention_ref
from hetero.kernels.paged_sinks import paged_attention_sinks_ref
from tests.kernels.test_triton_decode import fine  # noqa: F401 (a fixture)
from tests.kernels.test_triton_paged import Pool, assert_attention_close, make_step
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401

triton = pytest.importorskip("triton")

test_in_a_fresh_interpreter_process = rerun_test(__file__)

WINDOWS = [0, 1, 5, 37]


def plain_softmax(q, k, v, pos, scale, window, sinks):
    """One query [H, D] at `pos` over keys [L, KV, D]: scores, window mask, sink column."""
    h, kv = q.shape[0], k.shape[1]
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)  # [L, H, D]
    s = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    lo = pos - window + 1 if window else 0
    s[:, : max(lo, 0)] = float("-inf")
    s[:, pos + 1 :] = float("-inf")
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None]), 1)
    p = s.softmax(-1)[:, : k.shape[0]]
    return torch.einsum("hl,lhd->hd", p, v.double())


def sinks_for(h: int, on: bool, gen) -> torch.Tensor | None:
    return (2 * torch.randn(h, generator=gen)).to(DEVICE) if on else None


def test_reference_equals_a_plain_softmax():
    gen = torch.Generator().manual_seed(0)
    pool = Pool(32, 4, 2, 16, "fp16")
    q, meta = make_step(pool, [23, 9], [5, 1], 6, torch.float32, gen)
    sinks = sinks_for(6, True, gen)
    for window in WINDOWS:
        got = paged_attention_sinks_ref(q, *pool.caches(), meta, 0.25, window, sinks)
        for b, (start, n, slots) in enumerate(zip(meta.q_starts, meta.q_lens, meta.ctx_slots)):
            k = kv_read(pool.k, None, slots, torch.float32)
            v = kv_read(pool.v, None, slots, torch.float32)
            for i in range(n):
                pos = len(slots) - n + i
                want = plain_softmax(q[start + i], k, v, pos, 0.25, window, sinks)
                assert torch.allclose(got[start + i].double(), want, atol=1e-5), (window, b, i)
    plain = paged_attention_ref(q, *pool.caches(), meta, 0.25)
    no_extras = paged_attention_sinks_ref(q, *pool.caches(), meta, 0.25, 0, None)
    assert torch.allclose(no_extras, plain, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.usefixtures("fine")
def test_decode(kv_dtype: str, use_sinks: bool):
    """The splits merged in the decode kernel and by the reduce kernel (`fine`: the 100-key
    row in 3 splits of 32 keys, the 37-key row in 2)."""
    kv, g, d, bs = 2, 3, 32, 4
    gen = torch.Generator().manual_seed(5 + use_sinks)
    pool = Pool(64, bs, kv, d, kv_dtype)
    q, meta = make_step(pool, [1, 37, 100], [1, 1, 1], kv * g, torch.float32, gen)
    sinks = sinks_for(kv * g, use_sinks, gen)
    for window in WINDOWS:
        want = paged_attention_sinks_ref(q, *pool.caches(), meta, d**-0.5, window, sinks)
        for merge in (True, False):
            got = tp.paged_decode(
                q, *pool.caches(), meta.tensors, d**-0.5, n_splits=3, window=window,
                sinks=sinks, merge=merge,
            )  # fmt: skip
            assert_attention_close(got, want)
    entry = tp.paged_attention_sinks_triton(q, *pool.caches(), meta, d**-0.5, 5, sinks)
    assert_attention_close(
        entry, paged_attention_sinks_ref(q, *pool.caches(), meta, d**-0.5, 5, sinks)
    )


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
def test_prefill(kv_dtype: str):
    """A fresh prompt, a prefix hit plus 37 new tokens over several query tiles, a decode row
    and a short chunk; query tiles of 16 rows, key tiles of 16."""
    kv, g, d, bs = 1, 3, 40, 8
    gen = torch.Generator().manual_seed(9)
    pool = Pool(64, bs, kv, d, kv_dtype)
    q, meta = make_step(pool, [19, 70, 33, 41], [19, 37, 1, 5], kv * g, torch.float32, gen)
    for window, on in ((0, True), (1, False), (5, True), (37, True)):
        sinks = sinks_for(kv * g, on, gen)
        want = paged_attention_sinks_ref(q, *pool.caches(), meta, d**-0.5, window, sinks)
        got = tp.paged_prefill(
            q, *pool.caches(), meta.tensors, d**-0.5, bm=16, bn=16, window=window, sinks=sinks
        )
        assert_attention_close(got, want)


def test_row_tiles_of_a_graph_step():
    """A chunk of 30 prompt rows and a decode, one-query rows, tiles of 8 (tests/kernels/
    test_triton_paged.py's graph layout): every row equals the reference's."""
    kv, g, d, bs = 2, 2, 32, 4
    gen = torch.Generator().manual_seed(13)
    pool = Pool(64, bs, kv, d, "fp16")
    ctx, q_lens = [50, 30], [1, 30]
    _, seq_meta = make_step(pool, ctx, q_lens, kv * g, torch.float32, gen)
    tables, lens, chunk, slots = [], [], [], []
    for i, (n, m) in enumerate(zip(ctx, q_lens)):
        for j in range(n - m + 1, n + 1):
            tables.append(seq_meta.tensors.block_tables[i].tolist())
            lens.append(j)
            chunk.append(i if m > 1 else -1)
            slots.append(seq_meta.ctx_slots[i][:j])
    rows = len(lens)
    tm = tensor_meta(tables, lens, [1] * rows, bs)
    width = max(len(t) for t in tables)
    tm.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    decode_lens, tile_lens = split_row_tiles(tm.seq_lens, torch.tensor(chunk), 8)
    tm.tiles = RowTiles(decode_lens, tile_lens, 8)
    meta = PagedMeta(list(range(rows)), [1] * rows, slots)
    meta.tensors = tm.to(DEVICE)
    q = torch.randn(rows, kv * g, d, generator=gen).to(DEVICE)
    sinks = sinks_for(kv * g, True, gen)
    for window in (0, 5, 11):
        ref_meta = PagedMeta(list(range(rows)), [1] * rows, slots)
        want = paged_attention_sinks_ref(q, *pool.caches(), ref_meta, d**-0.5, window, sinks)
        got = tp.paged_attention_sinks_triton(q, *pool.caches(), meta, d**-0.5, window, sinks)
        assert_attention_close(got, want)
