"""The Triton decode kernel (hetero.kernels.triton_decode_kernels, through triton_paged) against
the torch references: flash-decoding splits (GQA ratios 1/3/4, fp8 and fp16 caches, head dims
with a masked tail), the fp8 tiles decoded by the conversion instruction or with integers, the
splits merged in the kernel or by the reduce kernel, queries and rows of keys and values over
wide magnitudes, the rotation and store of the new token in the kernel, and its output quantized
for the linear after. Without CUDA under the interpreter on small shapes (its programs run one
after another: a race between splits shows only on the GPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetero.kernels import triton_paged as tp
from hetero.kernels.paged import kv_write_ref, paged_attention_ref, rope_attention_ref
from tests.kernels.test_triton_paged import CASES, Pool, assert_attention_close, make_step
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401 (autouse)

triton = pytest.importorskip("triton")

test_in_a_fresh_interpreter_process = rerun_test(__file__)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_decode_attention(kv_dtype: str, case: tuple[int, int, int, int]) -> None:
    """Contexts 1 .. 100 (one split, several, a ragged last one), fp32 and fp16 queries; the
    registered entry point once (splits sized from the shapes)."""
    kv, g, d, bs = case
    gen = torch.Generator().manual_seed(kv * 100 + g * 10 + bs)
    pool = Pool(128, bs, kv, d, kv_dtype)
    ctx = [1, 37, 100]
    for dtype in (torch.float32, torch.float16):
        q, meta = make_step(pool, ctx, [1] * len(ctx), kv * g, dtype, gen)
        want = paged_attention_ref(q, *pool.caches(), meta, d**-0.5)
        got = tp.paged_decode(q, *pool.caches(), meta.tensors, d**-0.5, n_splits=4)
        assert_attention_close(got, want)
    assert_attention_close(tp.paged_attention_triton(q, *pool.caches(), meta, d**-0.5), want)


@pytest.fixture(params=[False, True], ids=["splits-of-64", "splits-of-4"])
def fine(request, monkeypatch) -> bool:
    """Decode splits as shipped, or of 4 keys or more merged 2 at a time (many splits, and
    merges over several loads, on small contexts)."""
    if request.param:
        monkeypatch.setattr(tp, "MIN_SPLIT", 4)
        monkeypatch.setattr(tp, "MERGE_SPLITS", 2)
    return request.param


@pytest.mark.parametrize("hw", [True, False], ids=["fp8-instruction", "fp8-integers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_paths_and_magnitudes(hw: bool, dtype: torch.dtype, fine: bool, monkeypatch):
    """fp8 codes decoded by the conversion (sm_89+) or with integers, one split (written
    directly), several merged by the last split of each KV head (one launch) or by the reduce
    kernel: all equal the reference, over rows of keys and values whose magnitudes span 1e-6
    .. 1 and 1e-2 .. 1e4 (their rows' scales meet the scores and probabilities, not the
    tiles) and queries from 1e-6 to 1e6 (a 16-bit query goes to float16 divided by a power
    of two; the keys shrink as the queries grow, keeping the softmax's conditioning); the
    merge's counters are left at 0 for the next launch. With `fine` splits the 97-key row
    takes 8 splits of whole 32-key tiles, 4 of them empty."""
    monkeypatch.setattr(tp, "hw_fp8", lambda device: hw)
    kv, g, d, bs = 2, 4, 32, 4
    gen = torch.Generator().manual_seed(5)
    pool = Pool(64, bs, kv, d, "fp8")
    ctx = [0, 1, 45, 97]
    q, meta = make_step(pool, ctx, [1] * len(ctx), kv * g, torch.float32, gen)
    slots = torch.cat(meta.ctx_slots)
    mags = torch.logspace(-6, 0, len(slots))[torch.randperm(len(slots), generator=gen)]
    k = torch.randn(len(slots), kv, d, generator=gen) * mags[:, None, None]
    v = torch.randn(len(slots), kv, d, generator=gen) * (1e4 * mags.flip(0) ** 0.5)[:, None, None]
    top = 6e4 if dtype == torch.float16 else 1e6
    for q_mag in (1e-6, 1.0, top):
        kv_write_ref(*pool.caches(), slots, (k * 4 / q_mag).to(DEVICE), v.to(DEVICE))
        qs = (q * q_mag / q.abs().amax(-1, keepdim=True)).to(dtype)
        want = paged_attention_ref(qs, *pool.caches(), meta, d**-0.5)
        for n, merge in ((1, True), (3, True), (3, False), (8, True)):
            got = tp.paged_decode(qs, *pool.caches(), meta.tensors, d**-0.5, n, merge=merge)
            assert torch.equal(got[0], torch.zeros_like(got[0]))  # length 0
            assert_attention_close(got[1:], want[1:], values=1e4)
            assert not tp._counters(DEVICE, 1).any()


def new_tokens(pool: Pool, meta, h: int, dtype, gen, rotary: int):
    """A decode step's q, k, v [B, *, D] not yet rotated (k and v not yet stored: their slots,
    each context's last, are the step's), rotation tables [B, rotary] and the slots (a sequence
    of no context: padding, slot -1)."""
    b, kv, d = len(meta.ctx_slots), pool.kv, pool.d
    q, k, v = (torch.randn(b, n, d, generator=gen).to(DEVICE, dtype) for n in (h, kv, kv))
    ang = torch.rand(b, rotary, generator=gen) * 6.3
    slots = torch.tensor([int(c[-1]) if len(c) else -1 for c in meta.ctx_slots], device=DEVICE)
    return q, k, v, ang.cos().to(DEVICE), ang.sin().to(DEVICE), slots


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("style", ["normal", "neox"])
def test_decode_rotates_and_stores_the_new_token(
    kv_dtype: str, style: str, fine: bool, monkeypatch
) -> None:
    """A decode step from q and k not yet rotated: the decode kernel rotates them and stores
    the new k and v itself (the split that holds the new key writes them before reading), bit
    for bit the rotation-and-write kernel then the decode kernel (the output and the caches);
    every dim rotated or the first 2 x 12 of 32; the reference's output. A prefill step, or rows
    that may share a sequence: None.
    A grid of 64 SMs' splits (`fine`: the 97-key row's new key in its 4th of 12 splits)."""
    monkeypatch.setattr(tp, "_sm_count", lambda device: 64)
    kv, g, d, bs = 2, 3, 32, 4
    gen = torch.Generator().manual_seed(12)
    ctx = [0, 1, 7, 45, 97]
    for rotary in (d // 2, 12):
        pools = [Pool(64, bs, kv, d, kv_dtype) for _ in range(3)]
        _, meta = make_step(pools[0], ctx, [1] * len(ctx), kv * g, torch.float16, gen)
        for p in pools[1:]:  # the same contexts in each
            for a, b in zip(p.caches(), pools[0].caches()):
                if a is not None:
                    a.copy_(b)
        q, k, v, cos, sin, slots = new_tokens(pools[0], meta, kv * g, torch.float16, gen, rotary)
        rope = (q, k, v, cos, sin, style)
        got = tp.rope_attention_triton(*rope, *pools[0].caches(), slots, meta, d**-0.5)
        assert got[1] is None and got[2] is None
        qr = tp.rope_kv_write_triton(*rope, *pools[1].caches(), slots)
        two = tp.paged_decode(qr, *pools[1].caches(), meta.tensors, d**-0.5)
        assert torch.equal(got[0], two)
        for a, b in zip(pools[0].caches(), pools[1].caches()):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        want = rope_attention_ref(*rope, *pools[2].caches(), slots, meta, d**-0.5)[0]
        assert_attention_close(got[0][1:], want[1:])
        assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))  # padding: no context
    qp, metap = make_step(pools[0], [9], [3], kv * g, torch.float16, gen)  # prefill: None
    k3 = torch.zeros(3, kv, d, device=DEVICE, dtype=torch.float16)
    args = (qp, k3, k3, cos[:1].expand(3, -1), sin[:1].expand(3, -1), style)
    assert tp.rope_attention_triton(*args, *pools[0].caches(), slots[:3], metap, 0.1) is None
    # rows that may be one sequence's (a graph's verify rows): each row's key is another's
    meta.tensors = dataclasses.replace(meta.tensors, shared=True)
    assert tp.rope_attention_triton(*rope, *pools[0].caches(), slots, meta, 0.1) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_output_quantized_for_the_next_linear(fine: bool, dtype, monkeypatch) -> None:
    """The decode kernel's output also in xquant's layout (words and floats) for the integer
    GEMV after it, written by the programs that write the output (one split's, or the merging
    one's): equal to xquant_ref of that output bit for bit, for Q4_K's layout, Q6_K's
    (regrouped, units of 16) and Q8_0's (chunks of 16); the output itself as the reference's.
    A float32 q or head groups that are no whole chunks: the output alone."""
    from hetero.kernels.xquant import XLayout, xquant_ref

    monkeypatch.setattr(tp, "_sm_count", lambda device: 64)  # several splits, merged

    kv, g, d, bs = 2, 4, 32, 4
    gen = torch.Generator().manual_seed(8)
    pool, ref = Pool(64, bs, kv, d, "fp8"), Pool(64, bs, kv, d, "fp8")
    ctx = [0, 7, 45, 97]
    _, meta = make_step(pool, ctx, [1] * len(ctx), kv * g, dtype, gen)
    for a, b in zip(ref.caches(), pool.caches()):
        a.copy_(b)
    *made, slots = new_tokens(pool, meta, kv * g, dtype, gen, d // 2)
    rope = (*made, "normal")
    want = rope_attention_ref(*rope, *ref.caches(), slots, meta, d**-0.5)[0]
    for layout in (XLayout(4, 32), XLayout(4, 16), XLayout(8, 32)):
        out, words, floats = tp.rope_attention_triton(
            *rope, *pool.caches(), slots, meta, d**-0.5, layout
        )  # fmt: skip
        assert_attention_close(out, want)
        ref_words, ref_floats = xquant_ref(out.reshape(len(ctx), -1), layout)
        assert torch.equal(words, ref_words) and torch.equal(floats, ref_floats)
    lay = XLayout(4, 32)
    rope32 = (rope[0].float(), rope[1].float(), rope[2].float(), *rope[3:])
    got = tp.rope_attention_triton(*rope32, *pool.caches(), slots, meta, 0.1, lay)
    assert got[1] is None
    odd = Pool(64, bs, 2, 24, "fp8")  # 4 heads of 24: 96 elements a group
    _, meta3 = make_step(odd, [5], [1], 8, dtype, gen)
    *made, slots3 = new_tokens(odd, meta3, 8, dtype, gen, 12)
    got = tp.rope_attention_triton(*made, "normal", *odd.caches(), slots3, meta3, 0.1, lay)
    assert got[1] is None and got[0].shape == (1, 8, 24)
