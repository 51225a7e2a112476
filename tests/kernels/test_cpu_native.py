"""The C versions of the small ops (kernels/cpu_native.py) against their torch references."""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import implementations, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler builds the kernels")


def pair(op: str):
    impls = {i.name: i.fn for i in implementations(op)}
    return impls["torch"], impls["native"]


@pytest.mark.parametrize("shape", [(1, 576), (17, 64), (3, 5, 96), (0, 32)])
def test_rms_norm(shape):
    ref, fast = pair("rms_norm")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(fast(x, w, 1e-5), ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    strided = torch.randn(shape[0], 2 * shape[-1], generator=g)[:, ::2] if len(shape) == 2 else x
    torch.testing.assert_close(fast(strided, w, 1e-6), ref(strided, w, 1e-6), rtol=1e-5, atol=1e-6)
    xb = x.to(torch.bfloat16)  # other dtypes take the torch path
    torch.testing.assert_close(fast(xb, w, 1e-5), ref(xb, w, 1e-5))


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (2, 3, 64)])
def test_add_rms_norm(shape):
    ref, fast = pair("add_rms_norm")
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    (n1, t1), (n2, t2) = fast(x, r, w, 1e-6), ref(x, r, w, 1e-6)
    assert torch.equal(t1, t2)  # the sum is one float32 add either way
    torch.testing.assert_close(n1, n2, rtol=1e-5, atol=1e-6)


def test_silu_mul_on_split_views_and_contiguous():
    ref, fast = pair("silu_mul")
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(5, 2 * 1536, generator=g) * 4  # gate | up as the fused linear gives them
    gate, up = fused.split(1536, dim=-1)
    torch.testing.assert_close(fast(gate, up), ref(gate, up), rtol=1e-5, atol=1e-6)
    a, b = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    torch.testing.assert_close(fast(a, b), ref(a, b), rtol=1e-5, atol=1e-6)
    big = torch.tensor([[-100.0, 100.0, 0.0, -1e-3]])  # exp overflow and underflow stay finite
    torch.testing.assert_close(fast(big, big), ref(big, big))


def _paged_case(dtype, q_lens, ctx_lens, heads=(9, 3), d=64, seed=0):
    """A random pool and sequences: per sequence q_len new queries at the end of its context,
    its slots scattered over the pool (the new tokens' KV already written)."""
    from hetero.execution.runner import PagedMeta
    from hetero.kernels.paged import FP8, quantize_fp8

    g = torch.Generator().manual_seed(seed)
    h, kv = heads
    n_slots = sum(ctx_lens) + 37
    k, v = (torch.randn(n_slots, kv, d, generator=g) * 2 for _ in range(2))
    ks = vs = None
    if dtype == FP8:
        (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
    else:
        kc, vc = k.to(dtype), v.to(dtype)
    perm = torch.randperm(n_slots, generator=g)
    ctx, starts, at, row = [], [], 0, 0
    for n, c in zip(q_lens, ctx_lens, strict=True):
        ctx.append(perm[at : at + c])
        starts.append(row)
        at, row = at + c, row + n
    q = torch.randn(row, h, d, generator=g)
    return q, kc, vc, ks, vs, PagedMeta(starts, list(q_lens), ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"])
@pytest.mark.parametrize(
    "q_lens, ctx_lens",
    [
        ([1] * 16, [100 + 7 * i for i in range(16)]),  # decodes of unequal lengths
        ([5], [5]),  # a first prefill chunk
        ([12, 1, 3], [40, 1, 19]),  # a chunk after a cached prefix, a fresh decode, guesses
    ],
)
def test_paged_attention_reads_the_cache_in_place(dtype, q_lens, ctx_lens):
    from hetero.kernels.paged import FP8

    dtype = FP8 if dtype == "fp8" else dtype
    ref, fast = pair("paged_attention")
    q, kc, vc, ks, vs, meta = _paged_case(dtype, q_lens, ctx_lens)
    want = ref(q, kc, vc, ks, vs, meta, 0.125)
    got = fast(q, kc, vc, ks, vs, meta, 0.125)
    assert meta.native_flat is not None  # the C kernel ran, not the fallback
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    again = fast(q, kc, vc, ks, vs, meta, 0.125)  # the flat arrays are reused
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"])
@pytest.mark.parametrize(
    "q_lens, ctx_lens, heads",
    [
        ([1], [700], (8, 2)),  # one decode, long context: 2 tasks, its context in parts
        ([1, 1], [600, 2], (9, 3)),  # a context shorter than the parts: empty parts
        ([3], [300], (8, 4)),  # guesses of one sequence: each row its own length
    ],
)
def test_paged_attention_splits_few_long_contexts(dtype, q_lens, ctx_lens, heads):
    """Few (row, KV head) tasks over long contexts are cut into parts that run in parallel and
    are combined: the same attention, whatever the thread count."""
    from hetero.kernels.paged import FP8

    dtype = FP8 if dtype == "fp8" else dtype
    ref, fast = pair("paged_attention")
    q, kc, vc, ks, vs, meta = _paged_case(dtype, q_lens, ctx_lens, heads=heads, seed=4)
    want = ref(q, kc, vc, ks, vs, meta, 0.125)
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = fast(q, kc, vc, ks, vs, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert meta.native_flat is not None
    torch.testing.assert_close(got[1], want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[2], got[1]) and torch.equal(got[3], got[1])


def test_paged_attention_on_a_strided_query_and_odd_shapes():
    ref, fast = pair("paged_attention")
    q, kc, vc, ks, vs, meta = _paged_case(torch.float16, [3, 1], [9, 30], heads=(4, 4), d=40)
    fused = torch.cat([q.flatten(1), torch.randn(q.shape[0], 17)], dim=1)  # q as a view
    view = fused[:, : q.shape[1] * q.shape[2]].view(q.shape)
    assert not view.is_contiguous()
    want = ref(q, kc, vc, ks, vs, meta, 0.3)
    torch.testing.assert_close(fast(view, kc, vc, ks, vs, meta, 0.3), want, rtol=1e-4, atol=1e-5)
    # bfloat16 caches are not the kernel's: the torch path answers, the same
    qb, kb, vb, _, _, mb = _paged_case(torch.bfloat16, [2], [6])
    torch.testing.assert_close(
        fast(qb, kb, vb, None, None, mb, 0.2), ref(qb, kb, vb, None, None, mb, 0.2)
    )
    assert mb.native_flat is None


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("rot", [32, 20])  # every dim, or a partial rotary part (2R < D)
def test_rope_on_a_view_of_the_fused_projection(style, rot):
    ref, fast = pair("rope")
    g = torch.Generator().manual_seed(3)
    t, h, d = 5, 6, 64
    fused = torch.randn(t, h * d + 96, generator=g)  # q | k heads, then v: a strided view
    x = fused[:, : h * d].view(t, h, d)
    ang = torch.randn(t, rot, generator=g)
    cos, sin = ang.cos(), ang.sin()
    assert torch.equal(fast(x, cos, sin, style), ref(x, cos, sin, style))  # bit for bit
    xb = x.to(torch.bfloat16)  # other dtypes take the torch path
    torch.testing.assert_close(fast(xb, cos, sin, style), ref(xb, cos, sin, style))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "fp8"])
def test_kv_write_from_strided_rows_skips_padding(dtype):
    from hetero.kernels.paged import FP8

    dtype = FP8 if dtype == "fp8" else dtype
    ref, fast = pair("kv_write")
    g = torch.Generator().manual_seed(4)
    t, kv, d, n_slots = 6, 3, 64, 40
    fused = torch.randn(t, 2 * kv * d + 50, generator=g) * 3
    k = fused[:, : kv * d].view(t, kv, d)
    v = fused[:, kv * d : 2 * kv * d].view(t, kv, d)
    slots = torch.tensor([7, 0, -1, 39, 12, -1])  # -1: a padding row, not stored
    caches = []
    for fn in (ref, fast):
        kc = torch.zeros(n_slots, kv, d, dtype=dtype)
        vc = torch.zeros(n_slots, kv, d, dtype=dtype)
        ks = vs = None
        if dtype == FP8:
            ks, vs = torch.zeros(n_slots, kv), torch.zeros(n_slots, kv)
        fn(kc, vc, ks, vs, slots, k, v)
        caches.append((kc, vc, ks, vs))
    for a, b in zip(*caches, strict=True):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit for bit
    assert caches[1][0].float().abs().sum() > 0


def test_prompt_sized_ops_split_their_rows_over_the_pool():
    """[96, 576]-sized and larger rows go to the native pool in items of at least 16K floats:
    every op gives, bit for bit, what it gives on one thread (rows are independent), and its
    reference's values. `threads` is the pool's: 3 here, whatever the machine's cores."""
    from hetero.kernels import cpu_threads

    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(96, 576, generator=g) * 3, torch.randn(96, 576, generator=g)
    w = torch.randn(576, generator=g)
    fused = torch.randn(64, 2 * 1536, generator=g) * 4
    gate, up = fused.split(1536, dim=-1)
    q = torch.randn(96, 9 * 64 + 96, generator=g)[:, : 9 * 64].view(96, 9, 64)
    ang = torch.randn(96, 32, generator=g)
    cases = {
        "rms_norm": (x, w, 1e-5),
        "add_rms_norm": (x, r, w, 1e-5),
        "silu_mul": (gate, up),
        "rope": (q, ang.cos(), ang.sin(), "neox"),
    }
    before = cpu_threads.get()
    try:
        for op, args in cases.items():
            ref, fast = pair(op)
            cpu_threads.configure(1)
            one = fast(*args)
            cpu_threads.configure(3)
            many = fast(*args)
            for a, b, want in zip(
                *(v if isinstance(v, tuple) else (v,) for v in (one, many, ref(*args)))
            ):
                assert torch.equal(a, b), op
                torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-5)
    finally:
        cpu_threads.configure(before)
