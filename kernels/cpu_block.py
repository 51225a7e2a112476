"""A dense transformer block on the CPU in one native call (kernels/cpu_block.c).

model/llama.py's Block runs, per layer, ~12 native calls with Python and torch between them:
the fused norms, the qdot linears (kernels/cpu_qdot.py), the rotation, the KV write and the
paged attention (kernels/cpu_native.py). Each linear streams megabytes of weights through the
caches, so the glue after it runs cold: on the 16-core host the first torch op after a linear
took ~70 us instead of 2, and a CPU decode step of Llama-3-8B spent ~0.3 ms a layer outside the
native calls. `DenseBlock` takes the block's weights once (pointers, shapes) and each call hands
over the step's tensors in one ctypes call that runs the same C functions in the same order:
the result equals the op-by-op path bit for bit (tests/kernels/test_cpu_block.py), which stays
the reference and the path for everything this does not take (experts, fp8 caches, biases in
float16, packed schemes other than qdot, the GPU offload of a big step's matmuls). Qwen3's
per-head q/k norms run in it too.

HETERO_NATIVE_BLOCK=0 turns it off (the op-by-op path, for comparisons).
"""

from __future__ import annotations

import ctypes
import os

import torch

from hetero.kernels import cpu_threads, native
from hetero.kernels.cpu_native import CACHE_DTYPES

MAX_PARTS = 4  # cpu_block.c
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("w", _P), ("n", _I64), ("type", _I32), ("pad", _I32)]


class _Linear(ctypes.Structure):
    _fields_ = [("part", _Part * MAX_PARTS), ("n_parts", _I32), ("pad", _I32), ("n", _I64)]


class _Block(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("attn_norm", _P), ("ffn_norm", _P), ("qkv_bias", _P), ("q_norm", _P), ("k_norm", _P),
        ("C", _I64), ("H", _I64), ("KV", _I64), ("D", _I64), ("F", _I64), ("R", _I64),
        ("eps", _F32), ("scale", _F32), ("neox", _I32), ("cache_dtype", _I32),
    ]  # fmt: skip


class _Call(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("pending", _P), ("cos", _P), ("sin", _P), ("x_out", _P),
        ("pending_out", _P), ("k_cache", _P), ("v_cache", _P), ("slots", _P),
        ("q_start", _P), ("q_len", _P), ("ctx_len", _P), ("slot_off", _P), ("ctx", _P),
        ("T", _I64), ("S", _I64), ("nthreads", _I32), ("pad", _I32),
    ]  # fmt: skip


def enabled() -> bool:
    return os.environ.get("HETERO_NATIVE_BLOCK", "1") != "0" and native.available()


def _linear(parts: list[tuple[int, int, int]]) -> _Linear:
    """parts: (ggml_type, rows, weight pointer) in output order."""
    lin = _Linear()
    for i, (t, n, ptr) in enumerate(parts):
        lin.part[i] = _Part(ptr, n, t, 0)
    lin.n_parts, lin.n = len(parts), sum(n for _, n, _ in parts)
    return lin


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")


class DenseBlock:
    """One block's weights as the native call takes them. Linears are lists of qdot parts
    (ggml_type, rows, packed weight tensor); norms and the q|k|v bias float32 [C] / [QKV]."""

    def __init__(
        self, qkv, o, gate_up, down, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
        qkv_bias: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int, neox: bool,
        eps: float, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        linears = (qkv, o, gate_up, down)
        if any(not 1 <= len(parts) <= MAX_PARTS for parts in linears):
            raise ValueError(f"a linear of 1 .. {MAX_PARTS} parts only")
        norms = [attn_norm, ffn_norm, qkv_bias, *(qk_norms or ())]
        if not all(_f32(t) for t in norms):
            raise ValueError("norms and bias: contiguous float32 CPU tensors")
        if qk_norms is not None and any(n.shape != (head_dim,) for n in qk_norms):
            raise ValueError("q/k norms: one weight per head dim")
        self._keep = [w for parts in linears for _, _, w in parts] + norms
        b = self._b = _Block()
        for name, parts in zip(("qkv", "o", "gate_up", "down"), linears, strict=True):
            setattr(b, name, _linear([(t, n, w.data_ptr()) for t, n, w in parts]))
        c = attn_norm.shape[0]
        f = b.gate_up.n // 2
        if b.qkv.n != (heads + 2 * kv_heads) * head_dim or b.o.n != c or b.down.n != c:
            raise ValueError("the linears' widths do not match the heads")
        b.attn_norm, b.ffn_norm = attn_norm.data_ptr(), ffn_norm.data_ptr()
        b.qkv_bias = None if qkv_bias is None else qkv_bias.data_ptr()
        if qk_norms is not None:
            b.q_norm, b.k_norm = (n.data_ptr() for n in qk_norms)
        b.C, b.H, b.KV, b.D, b.F = c, heads, kv_heads, head_dim, f
        b.eps, b.neox = eps, int(neox)
        self.width = c
        self._fn = native.load().dense_block_forward

    def __call__(self, x, pending, cos, sin, kv) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + pending + attention, the feed-forward's output) as Block.forward returns them,
        or None where this call's tensors are not ones it takes. kv: the attention backend's
        native_layer() for this block (caches, new slots, flat metadata, scale)."""
        if kv is None or not (_f32(x) and _f32(pending) and _f32(cos) and _f32(sin)):
            return None
        k_cache, v_cache, slots, (q_start, q_len, ctx_len, slot_off, ctx), scale = kv
        code = CACHE_DTYPES.get(k_cache.dtype)  # the attention's codes; the KV write's
        t = x.shape[0]  # half flag for float32 (0) and float16 (1), which are all it takes
        if code not in (0, 1) or x.dim() != 2 or x.shape[1] != self.width or t == 0:
            return None
        if pending is not None and pending.shape != x.shape:
            return None
        r = cos.shape[-1]
        if cos.shape != (t, r) or sin.shape != (t, r) or 2 * r > self._b.D or slots.shape != (t,):
            return None
        self._b.cache_dtype, self._b.R, self._b.scale = code, r, scale
        x_out, pending_out = torch.empty_like(x), torch.empty_like(x)
        call = _Call(
            x.data_ptr(), None if pending is None else pending.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), x_out.data_ptr(), pending_out.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), q_start.data_ptr(), q_len.data_ptr(),
            ctx_len.data_ptr(), slot_off.data_ptr(), ctx.data_ptr(), t, q_start.shape[0],
            cpu_threads.get(), 0,
        )  # fmt: skip
        rc = self._fn(ctypes.byref(self._b), ctypes.byref(call))
        if rc == 1:  # the KV write or the attention refused (e.g. float16 without F16C): the
            return None  # op-by-op path redoes the block (a KV row written twice is the same)
        if rc == -2:
            raise MemoryError("dense block: no memory for its scratch")
        if rc:
            raise ValueError(f"dense block: qdot refused a linear ({rc})")
        return x_out, pending_out
