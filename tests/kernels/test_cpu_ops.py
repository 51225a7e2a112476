"""The CPU versions of the small ops (kernels/cpu_ops.py) against their torch references."""

from __future__ import annotations

import pytest
import torch

from hetero.execution.runner import PagedMeta
from hetero.kernels import implementations, native, select

KV_DTYPES = [torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32]
SLOTS, KV, H, D = 256, 3, 9, 64


def pair(op: str):
    impls = {i.name: i.fn for i in implementations(op)}
    return impls["torch"], impls["cpu"]


def test_cpu_versions_are_selected_on_cpu_only():
    native_ops = ("rms_norm", "add_rms_norm", "silu_mul", "paged_attention", "rope", "kv_write")
    for op in ("paged_attention", "kv_write", "rms_norm", "rope", "silu_mul"):
        expected = "native" if op in native_ops and native.available() else "cpu"
        assert select(op, "cpu").name == expected
        assert select(op, "cuda").name not in ("cpu", "native")


def empty_caches(dtype):
    """k, v [SLOTS, KV, D] and, for fp8, their scales [SLOTS, KV]."""
    k, v = torch.zeros(SLOTS, KV, D, dtype=dtype), torch.zeros(SLOTS, KV, D, dtype=dtype)
    if dtype != torch.float8_e4m3fn:
        return k, v, None, None
    return k, v, torch.zeros(SLOTS, KV), torch.zeros(SLOTS, KV)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_kv_write_stores_the_same_bytes(dtype):
    ref, cpu = pair("kv_write")
    a, b = empty_caches(dtype), empty_caches(dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(SLOTS, generator=g)[:40]
    kv = torch.randn(40, KV, D, generator=g) * 3, torch.randn(40, KV, D, generator=g)
    ref(*a, slots, *kv)
    cpu(*b, slots[:25], kv[0][:25], kv[1][:25])
    # a strided k (a view into a fused projection's output) is written the same
    wide = torch.cat([kv[0][25:], kv[0][25:]], dim=-1)[..., :D]
    cpu(*b, slots[25:], wide, kv[1][25:])
    for x, y in zip(a, b):
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def filled_caches(dtype, seed=1):
    caches = empty_caches(dtype)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(SLOTS, KV, D, generator=g) * 2, torch.randn(SLOTS, KV, D, generator=g)
    select("kv_write", "cpu").fn(*caches, torch.arange(SLOTS), k, v)
    return caches


def decode_meta(lengths, g):
    ctx = [torch.randperm(SLOTS, generator=g)[:n] for n in lengths]
    lmax = max(lengths)
    slots = torch.zeros(len(lengths), lmax, dtype=torch.long)
    mask = torch.zeros(len(lengths), lmax, dtype=torch.bool)
    for b, c in enumerate(ctx):
        slots[b, : len(c)], mask[b, : len(c)] = c, True
    return PagedMeta(list(range(len(lengths))), [1] * len(lengths), ctx, slots, mask)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[37], [20, 20, 20], [5, 64, 33, 1]], ids=str)
def test_decode_attention_matches_reference(dtype, lengths):
    ref, cpu = pair("paged_attention")
    caches = filled_caches(dtype)
    g = torch.Generator().manual_seed(len(lengths))
    meta = decode_meta(lengths, g)
    q = torch.randn(len(lengths), H, D, generator=g)
    want, got = ref(q, *caches, meta, D**-0.5), cpu(q, *caches, meta, D**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16], ids=str)
def test_prefill_chunks_match_reference(dtype):
    """Sequences with several new queries each (a chunk after a cached prefix, a new prompt)."""
    ref, cpu = pair("paged_attention")
    caches = filled_caches(dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    ctx = [torch.randperm(SLOTS, generator=g)[:n] for n in (50, 7, 1)]
    meta = PagedMeta([0, 16, 23], [16, 7, 1], ctx)
    q = torch.randn(24, H, D, generator=g)
    torch.testing.assert_close(
        cpu(q, *caches, meta, 0.1), ref(q, *caches, meta, 0.1), rtol=1e-5, atol=1e-5
    )


def test_rms_norm_and_silu_mul_match_reference():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 576, generator=g) * 4, torch.randn(576, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ref, cpu = pair("rms_norm")
        torch.testing.assert_close(cpu(x.to(dtype), w, 1e-5), ref(x.to(dtype), w, 1e-5))
    gate, up = torch.randn(5, 1536, generator=g), torch.randn(5, 1536, generator=g)
    ref, cpu = pair("silu_mul")
    torch.testing.assert_close(cpu(gate, up), ref(gate, up))


@pytest.mark.parametrize("style", ["normal", "neox"])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_matches_reference_on_strided_heads(style, rope_dim):
    """q|k heads as a view of a fused q|k|v output, as the model passes them."""
    ref, cpu = pair("rope")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (H + 2 * KV) * D, generator=g) * 3
    qk = qkv[:, : (H + KV) * D].view(6, H + KV, D)
    ang = torch.rand(6, rope_dim // 2, generator=g) * 100
    got = cpu(qk, ang.cos(), ang.sin(), style)
    torch.testing.assert_close(got, ref(qk, ang.cos(), ang.sin(), style), rtol=1e-6, atol=1e-5)
    odd = torch.randn(6, 1 + H * D, generator=g)[:, 1:].view(6, H, D)  # odd storage offset
    torch.testing.assert_close(
        cpu(odd, ang.cos(), ang.sin(), style),
        ref(odd, ang.cos(), ang.sin(), style),
        rtol=1e-6,
        atol=1e-5,
    )


def test_auto_kv_dtype_is_fp16_on_cpu_and_choices_are_kept():
    from hetero.engine.config import EngineConfig
    from hetero.execution.kv_pool import resolve_kv_dtype

    assert EngineConfig().kv_dtype == "auto"
    assert resolve_kv_dtype("auto", "cpu") == "fp16"
    for choice in ("fp8", "fp16", "bf16", "fp32"):
        assert resolve_kv_dtype(choice, "cpu") == choice
