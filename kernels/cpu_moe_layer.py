"""A mixture-of-experts feed-forward on the CPU in one native call (kernels/cpu_moe_layer.c): the
router's choice, the grouped expert matmuls on the qdot kernels (kernels/cpu_qdot_moe.py), the
activation and the weighted sum. T tokens, C model width, E experts, k a token, F expert width:

    h [T, C] float32
    ids, w = moe_route(h Wr^T (+ br))        (kernels/moe.py; or given)     [T, k]
    slots sorted by expert (route)                                           S = T * k
    gate, up = grouped(h, Wg, Wu) (+ bg, bu)     one quantization of h       [S, F] each
    a = silu(gate) * up, or swiglu_oai(gate, up)                             [S, F]
    o = grouped(a, Wd) (+ bd)                                                [S, C]
    out[t] = sum_j w[t, j] o[slot (t, j)]                                    [T, C]

A decode step of a Python layer around the grouped calls spent more time in its torch ops
(routing, sorting, gathers, the activation, the sum: ~20 small ops a layer) than in the expert
matmuls; here one ctypes call runs the layer, and the slots' bookkeeping is a counting sort.
`moe_layer_ref` is the same layer in torch around the same grouped matmuls, with the same
signature: given ids and w it equals the native call bit for bit (the activation is the
registry's silu_mul; the sum adds in the same order), and routing differs from it only in the
router's float32 dot products (summed in another order than torch's GEMM) and exp.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hetero.kernels import cpu_qdot, cpu_threads
from hetero.kernels.cpu_qdot_moe import PackedExperts, grouped_matmul, route
from hetero.kernels.moe import GATINGS, activation_fn, moe_combine_ref, moe_route_ref

ACTIVATIONS = ("silu", "swiglu_oai")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class _Layer(ctypes.Structure):
    """cpu_moe_layer.c's moe_layer, field for field."""

    _fields_ = [
        ("w", _P * 3), ("bias", _P * 3), ("expert_bytes", _I64 * 3),
        ("n_experts", _I64), ("d_model", _I64), ("d_ff", _I64),
        ("router", _P), ("router_bias", _P),
        ("type", _I32 * 3), ("act", _I32), ("gating", _I32), ("norm", _I32),
    ]  # fmt: skip


class _Hop(ctypes.Structure):
    """cpu_moe_layer.c's moe_hop: one call of the layer as a CUDA host function."""

    _fields_ = [
        ("layer", _P), ("h", _P), ("out", _P), ("wts", _P), ("ids", _P), ("T", _I64),
        ("k", _I32), ("nthreads", _I32), ("rc", _I32), ("calls", _I32),
    ]  # fmt: skip


@dataclass(eq=False)
class RouterWeights:
    """The router: float32 weight [E, C] (+ bias [E]), its gating (kernels/moe.py), k, norm."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    gating: str
    k: int
    norm: bool


@dataclass(eq=False)
class MoeLayer:
    """One layer's packed experts (gate, up [E, F, C], down [E, C, F]), float32 biases
    ([E, F], [E, F], [E, C] or None), activation, and the router where it runs here too."""

    gate: PackedExperts
    up: PackedExperts
    down: PackedExperts
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    activation: str
    router: RouterWeights | None = None
    _c: _Layer = field(init=False, repr=False)
    _fn: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        ws, r = (self.gate, self.up, self.down), self.router
        e, c, f = self.gate.n_experts, self.gate.k, self.gate.n
        if any((w.n_experts, w.n, w.k) != s for w, s in zip(ws, ((e, f, c),) * 2 + ((e, c, f),))):
            raise ValueError("experts: gate and up [E, F, C], down [E, C, F]")
        if r is not None and not _router_ok(r, e, c):
            raise ValueError(f"router: float32 contiguous [{e}, {c}] (+ [{e}]), one of {GATINGS}")
        st = _Layer()  # pointers into tensors this object holds
        for i, (w, b) in enumerate(zip(ws, self.biases, strict=True)):
            st.w[i], st.bias[i] = w.packed.data_ptr(), None if b is None else _bias(b, w).data_ptr()
            st.expert_bytes[i], st.type[i] = w.expert_bytes, int(w.ggml_type)
        st.n_experts, st.d_model, st.d_ff = e, c, f
        st.act = ACTIVATIONS.index(self.activation)
        if r is not None:
            st.router = r.weight.data_ptr()
            st.router_bias = None if r.bias is None else r.bias.data_ptr()
            st.gating, st.norm = GATINGS.index(r.gating), int(r.norm)
        self._c = st
        self._fn = cpu_qdot.load().moe_layer_forward  # taken once: a decode step calls it often

    @property
    def d_model(self) -> int:
        return self.gate.k

    def hop(self, h: int, out: int, t: int, threads: int = 0) -> _Hop:
        """The arguments of one routed call on h, out [t, C] float32 (their addresses) as a
        host function (moe_layer_hop, kernels/host_hop.py): the struct, holding what it points
        to; its rc after the call is moe_layer's (0, -1, -2, -3: raise_for)."""
        if self.router is None:
            raise ValueError("a host call routes: the layer needs its router")
        k, threads = self.router.k, threads or cpu_threads.get()
        args = _Hop(ctypes.addressof(self._c), h, out, None, None, t, k, threads)
        args.keep = (self, torch.empty(t, k, dtype=torch.int64), torch.empty(t, k))
        args.ids, args.wts = args.keep[1].data_ptr(), args.keep[2].data_ptr()
        return args

    @staticmethod
    def hop_fn() -> int:
        """The address of moe_layer_hop, the host function that takes hop()'s arguments."""
        return ctypes.cast(cpu_qdot.load().moe_layer_hop, ctypes.c_void_p).value or 0

    def raise_for(self, rc: int) -> None:
        """moe_layer_forward's result code as the error it means (none for 0)."""
        if rc == -2:
            raise MemoryError("moe layer: no memory for its scratch")
        if rc == -3:
            raise ValueError(f"expert ids must be in 0..{self.gate.n_experts - 1}")
        if rc:
            raise ValueError("moe layer: an expert type or width the qdot kernels do not take")


def _router_ok(r: RouterWeights, e: int, c: int) -> bool:
    tensors = [(r.weight, (e, c))] + ([] if r.bias is None else [(r.bias, (e,))])
    return r.gating in GATINGS and all(
        t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == s for t, s in tensors
    )


def _bias(b: torch.Tensor, w: PackedExperts) -> torch.Tensor:
    if b.dtype != torch.float32 or not b.is_contiguous() or tuple(b.shape) != (w.n_experts, w.n):
        raise ValueError(f"expert biases are contiguous float32 [{w.n_experts}, {w.n}]")
    return b


def _choice(layer: MoeLayer, t: int, ids, w) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(ids [T, k] int64, w [T, k] float32, route): given, or empty for the router to fill."""
    if ids is not None:
        if ids.dim() != 2 or ids.shape[0] != t or w.shape != ids.shape:
            raise ValueError(f"ids and w must be [{t}, k], got {ids.shape} and {w.shape}")
        return ids.to(torch.int64).contiguous(), w.to(torch.float32).contiguous(), False
    if layer.router is None:
        raise ValueError("no router in this layer: pass ids and w")
    k = layer.router.k
    return torch.empty(t, k, dtype=torch.int64), torch.empty(t, k), True


def moe_layer(
    layer: MoeLayer, h: torch.Tensor, ids=None, w=None, threads: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, C], ids [T, k], w [T, k]) of h [T, C] float32: routed by the layer's router, or
    by the given ids, w (the router ran elsewhere)."""
    h = h.contiguous()
    if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != layer.d_model:
        raise ValueError(f"h must be float32 [T, {layer.d_model}], got {h.dtype} {h.shape}")
    ids, w, routing = _choice(layer, h.shape[0], ids, w)
    out = torch.empty_like(h)
    rc = layer._fn(
        ctypes.addressof(layer._c), h.data_ptr(), h.shape[0], ids.shape[1], ids.data_ptr(),
        w.data_ptr(), out.data_ptr(), int(routing), threads or cpu_threads.get(),
    )  # fmt: skip
    layer.raise_for(rc)
    return out, ids, w


def moe_layer_ref(
    layer: MoeLayer, h: torch.Tensor, ids=None, w=None, threads: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_layer in torch around the grouped matmuls (kernels/cpu_qdot_moe.py)."""
    if ids is None:
        r = layer.router
        if r is None:
            raise ValueError("no router in this layer: pass ids and w")
        ids, w = moe_route_ref(F.linear(h, r.weight, r.bias), r.k, r.gating, r.norm)
    rt = route(ids, layer.gate.n_experts)
    same = layer.gate.ggml_type == layer.up.ggml_type
    pairs = [[layer.gate, layer.up]] if same else [[layer.gate], [layer.up]]
    gate, up = (y for ws in pairs for y in grouped_matmul(h, ws, rt, True, threads))
    bg, bu, bd = layer.biases

    def biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return y if b is None else y + b[rt.expert_of]

    a = activation_fn(layer.activation, h.device)(biased(gate, bg), biased(up, bu))
    (down,) = grouped_matmul(a.contiguous(), [layer.down], rt, False, threads)
    o = torch.empty_like(down)
    o[rt.order] = biased(down, bd)  # back to slot order (t, j)
    return moe_combine_ref(o, w.float()), ids, w
