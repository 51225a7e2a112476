"""Native (C) versions of the small per-layer ops and of paged attention, registered above
kernels/cpu_ops.py's.

A decode step on the CPU calls rms_norm / add_rms_norm ~60 times and silu_mul 30 times on
[T, 576]-sized tensors; torch's rms_norm costs ~40 us a call there (a reduction's setup), the C
loop a few us through ctypes (kernels/cpu_small_ops.c). Float32 rows only; anything else (other
dtypes, odd strides) takes the torch path of the same op. Tested against the references in
tests/kernels/test_cpu_native.py.

Paged attention (kernels/cpu_attention.c) reads each context's K and V rows where they lie in the
cache instead of gathering a padded float32 copy for scaled_dot_product_attention: the host lists
of PagedMeta are flattened once per step (at its first layer) into the int64 arrays it takes.
"""

from __future__ import annotations

import itertools

import torch

from hetero.kernels import cpu_ops, cpu_threads, native
from hetero.kernels.paged import FP8
from hetero.kernels.registry import register


def native_cpu(device: torch.device) -> bool:
    return device.type == "cpu" and native.available()


def _rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_contiguous()


@register("rms_norm", "native", priority=2, supports=native_cpu)
def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_ref for float32 x [..., C] (a strided view, as Qwen3's q and k heads of the
    fused q|k|v output are, is copied first: the same C loop for every shape)."""
    if not (x.dtype == torch.float32 and _rows(weight)):
        return cpu_ops.rms_norm_cpu(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    c = x.shape[-1]
    native.load().native_rms_norm(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // max(c, 1),
        c,
        eps,
        cpu_threads.get(),
    )
    return out


@register("add_rms_norm", "native", priority=2, supports=native_cpu)
def add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref: (rms_norm(x + residual), x + residual) for float32 [..., C]."""
    if not (_rows(x) and _rows(residual) and _rows(weight)) or x.shape != residual.shape:
        total = x + residual
        return cpu_ops.rms_norm_cpu(total, weight, eps), total
    normed, total = torch.empty_like(x), torch.empty_like(x)
    c = x.shape[-1]
    native.load().native_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), normed.data_ptr(),
        total.data_ptr(), x.numel() // max(c, 1), c, eps, cpu_threads.get(),
    )  # fmt: skip
    return normed, total


@register("silu_mul", "native", priority=2, supports=native_cpu)
def silu_mul_native(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref for float32 gate, up [T, F] whose rows share one stride (split views)."""
    ok = gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype == torch.float32
    if not ok or gate.stride() != up.stride() or gate.stride(1) != 1:
        return cpu_ops.silu_mul_cpu(gate, up)
    t, f = gate.shape
    out = torch.empty(t, f)
    native.load().native_silu_mul(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), t, f, gate.stride(0), cpu_threads.get()
    )
    return out


@register("rope", "native", priority=2, supports=native_cpu)
def rope_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """rope_ref for float32 x [T, H, D] whose heads are contiguous (rows any stride): one call
    instead of the complex multiply's five ops."""
    t, h, d = x.shape
    r = cos.shape[-1]
    ok = (
        x.dtype == cos.dtype == sin.dtype == torch.float32
        and style in ("normal", "neox")
        and 2 * r <= d
        and x.stride(2) == 1
        and x.stride(1) == d
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (t, r)
    )
    if not ok:
        return cpu_ops.rope_cpu(x, cos, sin, style)
    out = torch.empty(t, h, d)
    native.load().native_rope(
        x.data_ptr(), x.stride(0), t, h, d, cos.data_ptr(), sin.data_ptr(), r,
        int(style == "neox"), out.data_ptr(), cpu_threads.get(),
    )  # fmt: skip
    return out


@register("kv_write", "native", priority=2, supports=native_cpu)
def kv_write_native(k_cache, v_cache, k_scale, v_scale, slots, k, v) -> None:
    """kv_write_ref for float32 or float16 caches from float32 k, v [T, KV, D] (rows any stride,
    heads contiguous), rows of slot -1 skipped; e4m3 caches take kernels/cpu_ops.py's path."""
    half = k_cache.dtype == torch.float16
    ok = (
        (half or k_cache.dtype == torch.float32)
        and k.dtype == v.dtype == torch.float32
        and k.shape == v.shape
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slots.dtype == torch.int64
        and slots.is_contiguous()
    )
    if ok:
        t, kv, d = k.shape
        failed = native.load().native_kv_write(
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k.data_ptr(), k.stride(0),
            v.data_ptr(), v.stride(0), t, kv * d, int(half),
        )  # fmt: skip
        if not failed:
            return
    keep = slots >= 0
    if not bool(keep.all()):  # padding rows: the torch path stores every row it is given
        slots, k, v = slots[keep], k[keep], v[keep]
    cpu_ops.kv_write_cpu(k_cache, v_cache, k_scale, v_scale, slots, k, v)


CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, FP8: 2}


def flat_meta(meta) -> tuple[torch.Tensor, ...]:
    """PagedMeta's host lists as the kernel's arrays, made once per step (the meta is shared by
    every layer): q_start, q_len, ctx_len, slot_off [S] and the concatenated slots."""
    flat = meta.native_flat
    if flat is None:
        lens = [int(c.shape[0]) for c in meta.ctx_slots]
        offsets = [0, *itertools.accumulate(lens[:-1])]
        as_i64 = [torch.tensor(v, dtype=torch.int64) for v in (meta.q_starts, meta.q_lens, lens)]
        slots = (
            torch.cat(meta.ctx_slots).to(torch.int64) if lens else torch.zeros(0, dtype=torch.int64)
        )
        flat = (*as_i64, torch.tensor(offsets, dtype=torch.int64), slots.contiguous())
        meta.native_flat = flat
    return flat


@register("paged_attention", "native", priority=2, supports=native_cpu)
def paged_attention_native(q, k_cache, v_cache, k_scale, v_scale, meta, scale: float):
    """paged_attention_ref for float32 q [T, H, D] (rows of H * D values, any row stride) over
    float32, float16 or e4m3 caches; anything else takes kernels/cpu_ops.py's path."""
    code = CACHE_DTYPES.get(k_cache.dtype)
    t, h, d = q.shape
    ok = (
        code is not None
        and q.dtype == torch.float32
        and q.stride(2) == 1
        and q.stride(1) == d
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and (code != 2 or (k_scale.is_contiguous() and v_scale.is_contiguous()))
        and len(meta.ctx_slots) == len(meta.q_starts) > 0
    )
    if ok:
        q_start, q_len, ctx_len, slot_off, slots = flat_meta(meta)
        out = torch.empty(t, h, d)
        scales = (k_scale.data_ptr(), v_scale.data_ptr()) if code == 2 else (None, None)
        failed = native.load().native_paged_attention(
            q.data_ptr(), q.stride(0), t, h, k_cache.shape[1], d, k_cache.data_ptr(),
            v_cache.data_ptr(), *scales, code, len(meta.q_starts), q_start.data_ptr(),
            q_len.data_ptr(), ctx_len.data_ptr(), slot_off.data_ptr(), slots.data_ptr(), scale,
            out.data_ptr(), cpu_threads.get(),
        )  # fmt: skip
        if not failed:
            return out
    return cpu_ops.paged_attention_cpu(q, k_cache, v_cache, k_scale, v_scale, meta, scale)
