"""Triton paged KV kernels (hetero.kernels.triton_paged) against the torch references.

Fused KV write (fp8 codes and scales bit for bit, fp16 exact, padding slots skipped), the
rotation fused with it, prefill over a cached prefix plus new tokens (varlen, causal, mixed with
decode rows), a graph step's row tiles, and every attention launch compiled for each target
architecture; the decode kernel's own tests are in test_triton_decode.py. Random block tables
(shuffled blocks), fresh random inputs. Without CUDA under the interpreter on small shapes; `gpu`
tests at model-like shapes.
"""

from __future__ import annotations

import pytest
import torch

from hetero.execution.paged_meta import RowTiles, split_row_tiles, tensor_meta
from hetero.execution.runner import PagedMeta
from hetero.kernels import implementations
from hetero.kernels import triton_paged as tp
from hetero.kernels.paged import FP8, kv_write_ref, paged_attention_ref, rope_kv_write_ref
from tests.support.triton_interp import CUDA, DEVICE, kernels_runnable, rerun_test  # noqa: F401 (autouse)

triton = pytest.importorskip("triton")
KV_DTYPES = {"fp8": FP8, "fp16": torch.float16}


test_in_a_fresh_interpreter_process = rerun_test(__file__)


class Pool:
    """One layer of a paged cache: k/v [blocks * bs, KV, D] (+ fp8 scales [slots, KV])."""

    def __init__(self, blocks: int, bs: int, kv: int, d: int, kv_dtype: str):
        dtype = KV_DTYPES[kv_dtype]
        n = blocks * bs
        self.bs, self.kv, self.d = bs, kv, d
        self.k = torch.zeros(n, kv, d, device=DEVICE).to(dtype)
        self.v = torch.zeros(n, kv, d, device=DEVICE).to(dtype)
        self.ks = self.vs = None
        if dtype == FP8:
            self.ks = torch.zeros(n, kv, device=DEVICE)
            self.vs = torch.zeros(n, kv, device=DEVICE)

    def caches(self):
        return self.k, self.v, self.ks, self.vs


def make_step(pool: Pool, ctx_lens: list[int], q_lens: list[int], h: int, dtype, gen):
    """Random block tables, contexts written by the reference; q [T, H, D] and the PagedMeta."""
    perm = torch.randperm(pool.k.shape[0] // pool.bs, generator=gen).tolist()
    tables, ctx_slots, used = [], [], 0
    for n in ctx_lens:
        nb = -(-n // pool.bs)
        tables.append(perm[used : used + nb])
        used += nb
        blocks = torch.tensor(tables[-1], dtype=torch.long)
        slots = (blocks[:, None] * pool.bs + torch.arange(pool.bs)).flatten()[:n].to(DEVICE)
        ctx_slots.append(slots)
        k = torch.randn(n, pool.kv, pool.d, generator=gen).to(DEVICE)
        v = torch.randn(n, pool.kv, pool.d, generator=gen).to(DEVICE)
        kv_write_ref(*pool.caches(), slots, k, v)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    meta = PagedMeta(starts, list(q_lens), ctx_slots)
    meta.tensors = tensor_meta(tables, ctx_lens, q_lens, pool.bs).to(DEVICE)
    q = torch.randn(sum(q_lens), h, pool.d, generator=gen).to(DEVICE, dtype)
    return q, meta


def assert_attention_close(got: torch.Tensor, want: torch.Tensor, values: float = 1.0) -> None:
    """Within the query dtype's rounding: the kernels multiply in it (tensor cores), the
    reference in float32; both round the output once (bf16: one ulp is 2^-8 relative).
    values: the magnitude of the values averaged (an output that cancels down from them keeps
    their absolute rounding)."""
    tol = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[got.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    excess = (got.float() - want.float()).abs() - tol * (values + want.float().abs())
    assert excess.max().item() <= 0, f"max error past the bound by {excess.max().item()}"


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
def test_kv_write_matches_reference_bits(kv_dtype: str) -> None:
    """Codes and scales equal the reference's; magnitudes from 1e-6 to 1e4 (e4m3 subnormals,
    ties, rounding carries into the exponent); slot -1 rows are skipped; strided k/v."""
    gen = torch.Generator().manual_seed(1)
    t, kv, d = 19, 3, 40
    mags = torch.logspace(-6, 4, t)[:, None, None]
    kvv = torch.randn(t, 2 * kv, d, generator=gen) * mags  # k|v fused: strided views
    k, v = kvv[:, :kv].to(DEVICE), kvv[:, kv:].to(DEVICE)
    slots = torch.randperm(32, generator=gen)[:t].to(DEVICE)
    slots[5] = -1
    ref, tri = Pool(8, 4, kv, d, kv_dtype), Pool(8, 4, kv, d, kv_dtype)
    kv_write_ref(*ref.caches(), slots, k, v)
    tp.kv_write_triton(*tri.caches(), slots, k, v)
    for a, b in zip(tri.caches(), ref.caches()):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not tri.k.view(torch.uint8).bool().all(-1).all(-1).all()  # some slots untouched


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_write_matches_reference_bits(kv_dtype: str, style: str, dtype) -> None:
    """The rotation and the KV write in one launch: q, k and v views of one q|k|v row (the
    matmul's output), every dim rotated or the first 2 x 12 of 40 (the rest copied); the
    rotated q and the caches' codes and scales equal the two launches it replaces (the rope
    kernel, then the KV write) bit for bit, and the torch reference's to float rounding (a
    compiled kernel contracts a * c - b * s into one FMA, torch does not); a slot of -1
    (padding) writes nothing."""
    from hetero.kernels.triton_fused import rope_triton

    gen = torch.Generator().manual_seed(3)
    t, h, kv, d = 5, 6, 2, 40
    qkv = (torch.randn(t, (h + 2 * kv) * d, generator=gen) * 3).to(DEVICE, dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kv) * d].view(t, kv, d)
    v = qkv[:, (h + kv) * d :].view(t, kv, d)
    slots = torch.tensor([7, 2, -1, 30, 11], device=DEVICE)
    for r in (d // 2, 12):
        ang = torch.rand(t, r, generator=gen) * 6.3
        cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
        ref, two, tri = (Pool(8, 4, kv, d, kv_dtype) for _ in range(3))
        want = rope_kv_write_ref(q, k, v, cos, sin, style, *ref.caches(), slots)
        tp.kv_write_triton(*two.caches(), slots, rope_triton(k, cos, sin, style), v)
        q_two = rope_triton(q, cos, sin, style)
        got = tp.rope_kv_write_triton(q, k, v, cos, sin, style, *tri.caches(), slots)
        assert torch.equal(got, q_two)
        torch.testing.assert_close(got, want, rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=0)
        for a, b in zip(tri.caches(), two.caches()):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(tri.caches(), ref.caches()):
            if a is not None and a.dtype != FP8:
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=0)
        written = tri.v.view(torch.uint8).flatten(1).any(-1).nonzero().flatten().tolist()
        assert written == sorted(s for s in slots.tolist() if s >= 0)


CASES = [  # (kv heads, group, head dim, block size)
    (2, 1, 32, 4),
    (1, 3, 40, 8),
    (2, 4, 16, 16),
]


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("case", CASES[:2])
def test_prefill_attention(kv_dtype: str, case: tuple[int, int, int, int]) -> None:
    """A prompt from scratch, a prefix hit plus new tokens over several query tiles, a decode
    row and a chunk whose first tile is partial, in one varlen batch (fp32 queries over fp8,
    fp16 over fp16)."""
    kv, g, d, bs = case
    gen = torch.Generator().manual_seed(7 + bs)
    pool = Pool(128, bs, kv, d, kv_dtype)
    ctx, q_lens = [19, 70, 33, 41], [19, 37, 1, 5]
    dtype = torch.float32 if kv_dtype == "fp8" else torch.float16
    q, meta = make_step(pool, ctx, q_lens, kv * g, dtype, gen)
    want = paged_attention_ref(q, *pool.caches(), meta, d**-0.5)
    got = tp.paged_prefill(q, *pool.caches(), meta.tensors, d**-0.5, bm=16, bn=16)
    assert_attention_close(got, want)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
def test_row_tiles_of_a_graph_step(kv_dtype: str) -> None:
    """A CUDA-graph step's layout: every new token a one-query row with its own table row and
    length (a decode, a chunk after a 27-token prefix, a decode, a fresh 30-token prompt, a
    padding row). Rows in 8-row tiles of one chunk attend through the tile kernel (the chunks
    start mid-tile, so some of their rows stay with the per-row kernel); every row equals the
    reference, and the tiled and untiled paths agree."""
    kv, g, d, bs = 2, 3, 32, 4
    gen = torch.Generator().manual_seed(11)
    pool = Pool(64, bs, kv, d, kv_dtype)
    ctx, q_lens = [40, 50, 9, 30], [1, 23, 1, 30]
    dtype = torch.float32 if kv_dtype == "fp8" else torch.float16
    _, seq_meta = make_step(pool, ctx, q_lens, kv * g, dtype, gen)
    tables, lens, chunk, slots = [], [], [], []
    for i, (n, m) in enumerate(zip(ctx, q_lens)):
        for j in range(n - m + 1, n + 1):  # the row of position j - 1 sees j keys
            tables.append(seq_meta.tensors.block_tables[i].tolist())
            lens.append(j)
            chunk.append(i if m > 1 else -1)
            slots.append(seq_meta.ctx_slots[i][:j])
    tables.append([0])  # padding: length 0
    lens.append(0)
    chunk.append(-1)
    slots.append(seq_meta.ctx_slots[0][:0])
    rows = len(lens)
    tm = tensor_meta(tables, lens, [1] * rows, bs)  # (sizes each row's table by its length:)
    width = max(len(t) for t in tables)  # a graph row holds its chunk's whole table, as here
    tm.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    decode_lens, tile_lens = split_row_tiles(tm.seq_lens, torch.tensor(chunk), 8)
    assert 0 < int((tile_lens > 0).sum()) < sum(q_lens[1::2])  # tiled rows, and untiled ones
    tm.tiles = RowTiles(decode_lens, tile_lens, 8)
    tm = tm.to(DEVICE)
    q = torch.randn(rows, kv * g, d, generator=gen).to(DEVICE, dtype)
    meta = PagedMeta(list(range(rows)), [1] * rows, slots)
    want = paged_attention_ref(q[:-1], *pool.caches(), PagedMeta(
        list(range(rows - 1)), [1] * (rows - 1), slots[:-1]), d**-0.5)  # fmt: skip
    meta.tensors = tm
    got = tp.paged_attention_triton(q, *pool.caches(), meta, d**-0.5)
    assert_attention_close(got[:-1], want)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    untiled = tp.paged_decode(q, *pool.caches(), tm, d**-0.5)
    assert_attention_close(untiled[:-1], want)


def test_padding_rows_give_zeros_and_reference_fallback() -> None:
    """A decode row of length 0 (graph padding) yields 0; a meta without tensors goes to the
    reference."""
    gen = torch.Generator().manual_seed(3)
    pool = Pool(16, 4, 1, 16, "fp8")
    q, meta = make_step(pool, [9, 0], [1, 1], 2, torch.float32, gen)
    got = tp.paged_decode(q, *pool.caches(), meta.tensors, 0.25, n_splits=3)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = paged_attention_ref(q[:1], *pool.caches(), PagedMeta([0], [1], meta.ctx_slots[:1]), 0.25)
    assert_attention_close(got[:1], want)
    meta.tensors = None
    assert torch.equal(tp.paged_attention_triton(q[:1], *pool.caches(), meta, 0.25), want)


def test_registered_with_device_support() -> None:
    for op in ("paged_attention", "kv_write", "rope_kv_write", "rope_attention"):
        impl = next(i for i in implementations(op) if i.name == "triton")
        assert not impl.supports(torch.device("cpu"))
        if CUDA:
            assert impl.supports(DEVICE) == (torch.cuda.get_device_capability()[0] >= 8)


COMPILE = """
import sys
import torch
from tests.support.triton_compile_check import compiling_for
from hetero.execution.paged_meta import RowTiles, TensorMeta
from hetero.kernels import triton_paged as tp
from hetero.kernels.paged import FP8
from hetero.kernels.xquant import XLayout
from types import SimpleNamespace
tp._sm_count = lambda device: 132
kv, h, d, bs, b = 8, 32, 128, 16, 4
for arch in map(int, sys.argv[1].split(",")):
    tp.hw_fp8 = lambda device: arch >= 89  # what that GPU's caps give
    for kv_dtype in (FP8, torch.bfloat16):
        kc = torch.zeros(256 * bs, kv, d, dtype=kv_dtype)
        sc = torch.ones(256 * bs, kv)
        caches = (kc, kc.clone(), sc, sc.clone())
        lens = torch.full((b,), 100, dtype=torch.int32)
        tm = TensorMeta(torch.zeros(b, 64, dtype=torch.int32), lens,
                        torch.arange(b + 1, dtype=torch.int32), 1, 1024, bs)
        q = torch.zeros(b, h, d, dtype=torch.bfloat16)
        runs = {
            "decode": lambda: tp.paged_decode(q, *caches, tm, 0.1),
            "decode_reduce": lambda: tp.paged_decode(q, *caches, tm, 0.1, merge=False),
            "decode_one": lambda: tp.paged_decode(q, *caches, tm, 0.1, n_splits=1),
            "prefill": lambda: tp.paged_prefill(q, *caches, tm, 0.1),
            "rows": lambda: tp.paged_rows(q, *caches, TensorMeta(
                tm.block_tables, lens, tm.q_start_loc, 1, 1024, bs,
                RowTiles(lens, lens, 4)), 0.1),
            "decode_xq": lambda: tp.rope_attention_triton(
                q, q[:, :kv], q[:, kv:2 * kv], torch.ones(b, d // 2), torch.zeros(b, d // 2),
                "neox", *caches, torch.arange(b), SimpleNamespace(tensors=tm), 0.1,
                XLayout(4, 16)),
            "rope_write": lambda: tp.rope_kv_write_triton(
                q, q[:, :kv], q[:, kv:2 * kv], torch.ones(b, d // 2), torch.zeros(b, d // 2),
                "normal", *caches, torch.arange(b)),
        }
        for name, run in runs.items():
            with compiling_for(arch) as log:
                run()
            for (fn, _), c in zip(log.compiled, log.kernels):
                hw = "cvt.rn.f16x2.e4m3x2" in c.asm["ptx"]
                print(arch, kv_dtype == FP8, name, fn, hw)
"""


def test_compiles_for_each_architecture() -> None:
    """Every attention launch (the output quantized in it too, and the rotation fused with the
    KV write) compiled for sm_80 .. sm_120 (a process without the interpreter): fp8 tiles
    decoded by the conversion instruction from sm_89 on, with integers before; the merge in
    the decode kernel, the reduce kernel only where asked for."""
    from tests.support.triton_compile_check import compile_in_subprocess

    archs = (80, 89, 90, 120)
    rows = [line.split() for line in compile_in_subprocess(COMPILE, ",".join(map(str, archs)))
            .splitlines()]  # fmt: skip
    kernels = {(run, fn) for _, _, run, fn, _ in rows}
    assert kernels == {
        ("decode", "decode_split_kernel"), ("decode_one", "decode_split_kernel"),
        ("decode_reduce", "decode_split_kernel"), ("decode_reduce", "decode_reduce_kernel"),
        ("prefill", "prefill_kernel"), ("rows", "decode_split_kernel"),
        ("rows", "row_tile_kernel"), ("rope_write", "rope_kv_write_kernel"),
        ("decode_xq", "decode_split_kernel"),
    }  # fmt: skip
    assert len(rows) == len(archs) * 2 * 9
    for arch, fp8, _, fn, hw in rows:
        reads = fn not in ("decode_reduce_kernel", "rope_kv_write_kernel") and fp8 == "True"
        assert (hw == "True") == (reads and int(arch) >= 89), (arch, fp8, fn, hw)


# ----------------------------------------------------------------------------- on the device


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama_shapes(kv_dtype: str, dtype: torch.dtype) -> None:
    """Llama-3-8B attention (32 heads over 8 KV, D 128, blocks of 16): decode of 64 sequences up
    to 4k context with auto splits, and a prefill batch with prefixes."""
    gen = torch.Generator().manual_seed(11)
    pool = Pool(8192, 16, 8, 128, kv_dtype)  # 24 contexts of up to 4k need up to 6144 blocks
    ctx = torch.randint(1, 4096, (24,), generator=gen).tolist()
    q, meta = make_step(pool, ctx, [1] * len(ctx), 32, dtype, gen)
    want = paged_attention_ref(q, *pool.caches(), meta, 128**-0.5)
    assert_attention_close(tp.paged_attention_triton(q, *pool.caches(), meta, 128**-0.5), want)
    ctx, q_lens = [512, 1500, 2000, 77], [512, 300, 1, 77]
    q, meta = make_step(pool, ctx, q_lens, 32, dtype, gen)
    want = paged_attention_ref(q, *pool.caches(), meta, 128**-0.5)
    assert_attention_close(tp.paged_attention_triton(q, *pool.caches(), meta, 128**-0.5), want)
