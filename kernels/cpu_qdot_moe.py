"""Mixture-of-experts matmuls on the qdot CPU kernels: every active expert's rows, read in their
GGUF blocks, times int8-quantized activations (kernels/cpu_qdot.py's scheme), in one native call.

A 3-D expert tensor [E, N, K] packs as one qdot weight of E * Np rows (Np: N rounded up to the
16-row groups, zero rows padding each expert), so expert e is the contiguous byte range
[e * expert_bytes, (e + 1) * expert_bytes) of the packed tensor: the call reads only the ranges
of the experts that tokens chose, and never copies one.

Slots s = t * k + j (token t's j-th choice, kernels/moe.py) are sorted by expert id, as vLLM's
fused_moe sorts them on a GPU (`route`): active expert a owns sorted slots offsets[a] ..
offsets[a + 1] - 1. The native call (kernels/cpu_qdot_moe.c) quantizes x once, gathers its rows
into slot order, and runs one pool job over (weight, expert, row groups, slots) items:

    gate/up  x [T, K], rows = token of each sorted slot   -> y [S, N] per weight, sorted order
    down     a [S, F] already in sorted order (rows None) -> y [S, C], sorted order

Each output row is what qdot_linear gives that row against its expert's slice (the same sums in
the same order): the activations' rounding is the only difference from the exact product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from hetero.kernels import cpu_qdot, cpu_threads
from hetero.quant import get_quant


@dataclass(eq=False)
class PackedExperts:
    """One expert tensor W [E, N, K] in qdot's layout: uint8 [E, Np / 16, K / block, unit]."""

    ggml_type: GGMLQuantizationType
    n_experts: int
    n: int
    k: int
    packed: torch.Tensor

    @property
    def expert_bytes(self) -> int:
        return self.packed[0].numel()


def runs_natively(ggml_type) -> bool:
    """Whether the qdot kernels read `ggml_type` blocks on this machine (the kernel table:
    the K-quants and legacy types, and whichever newer types it has been given)."""
    name = ggml_type if isinstance(ggml_type, str) else GGMLQuantizationType(int(ggml_type)).name
    return cpu_qdot.available() and name in {t.name for t in cpu_qdot.NATIVE_TYPES}


def pack_experts(raw: torch.Tensor, ggml_type, shape: tuple[int, int, int]) -> PackedExperts:
    """GGUF bytes of W [E, N, K] (any shape holding E * N rows of blocks) -> PackedExperts."""
    e, n, k = shape
    qt = get_quant(ggml_type)
    blocks = raw.reshape(e, n, -1)
    pad = -n % cpu_qdot.GROUP
    if pad:  # zero rows (d = 0): each expert starts on a group; their outputs are never read
        blocks = torch.cat((blocks, blocks.new_zeros(e, pad, blocks.shape[2])), dim=1)
    w = cpu_qdot.pack(blocks.reshape(e * (n + pad), -1), qt, e * (n + pad), k)
    return PackedExperts(qt.ggml_type, e, n, k, w.packed.view(e, -1, *w.packed.shape[1:]))


@dataclass
class Routing:
    """Slots sorted by expert: sorted slot i is slot order[i], token rows[i], of expert
    expert_of[i]; active expert experts[a] owns sorted slots offsets[a] .. offsets[a + 1] - 1."""

    order: torch.Tensor  # int64 [S]
    rows: torch.Tensor  # int64 [S]
    expert_of: torch.Tensor  # int64 [S]
    experts: torch.Tensor  # int64 [A]
    offsets: torch.Tensor  # int64 [A + 1]


def route(topk_ids: torch.Tensor, n_experts: int) -> Routing:
    """topk_ids [T, k] -> the slots grouped by expert (stable: a group keeps slot order)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < n_experts:
        raise ValueError(f"expert ids must be in 0..{n_experts - 1}")
    expert_of, order = flat.sort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    experts = counts.nonzero().squeeze(1)
    offsets = torch.zeros(experts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts[experts], 0, out=offsets[1:])
    return Routing(order, order // topk_ids.shape[1], expert_of, experts, offsets)


def _ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def grouped_matmul(
    x: torch.Tensor, weights: list[PackedExperts], r: Routing, gather: bool, threads: int = 0
) -> list[torch.Tensor]:
    """[y_i [S, N]] in sorted slot order: y_i[s] = x[row] @ W_i[expert_of[s]]^T, row = r.rows[s]
    (gather: x [T, K], its token rows) or s (x [S, K] already sorted). The weights share one
    type and shape (gate and up): one quantization of x, one pool job."""
    w0 = weights[0]
    if any((w.ggml_type, w.n, w.k, w.n_experts) != (w0.ggml_type, w0.n, w0.k, w0.n_experts)
           for w in weights):  # fmt: skip
        raise ValueError("a grouped call's weights share their type and shape")
    x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w0.k:
        raise ValueError(f"x must be float32 [rows, {w0.k}], got {x.dtype} {tuple(x.shape)}")
    s = int(r.order.numel())
    ys = [torch.empty(s, w0.n) for _ in weights]
    rows = r.rows if gather else None
    wptrs, yptrs = _ptrs([w.packed for w in weights]), _ptrs(ys)  # alive through the call
    rc = cpu_qdot.load().qdot_moe(
        int(w0.ggml_type), len(weights), wptrs.data_ptr(), yptrs.data_ptr(), w0.expert_bytes,
        w0.n, w0.k, int(r.experts.numel()),
        r.experts.data_ptr(), r.offsets.data_ptr(), x.data_ptr(), x.shape[0],
        rows.data_ptr() if rows is not None else None, threads or cpu_threads.get(),
    )  # fmt: skip
    if rc == -2:
        raise MemoryError("qdot: no memory for the quantized activations")
    if rc:
        raise ValueError(f"qdot: type {w0.ggml_type.name} with k = {w0.k} is not one it takes")
    return ys
