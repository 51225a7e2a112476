"""A layer's experts on the CPU's qdot kernels (kernels/cpu_qdot_moe.py): the expert layer of
model/moe.py when its experts run on a CPU in "qdot" weights mode (what "auto" means there).

    h [T, C], ids [T, k], w [T, k]
    slots sorted by expert (route)                                   S = T * k
    gate, up = grouped(h, Wg, Wu)   one quantization of h, one job   [S, F] each, sorted order
    a = act(gate (+ bg), up (+ bu))                                  [S, F]
    o = grouped(a, Wd) (+ bd)                                        [S, C], sorted order
    out[t] = sum_j w[t, j] o[slot (t, j)]                            [T, C]

Each expert tensor is packed once at load (its GGUF bytes moved, none changed, as the dense
qdot linears'); a call reads only the chosen experts' byte ranges. Layers whose expert types the
kernel table lacks (MXFP4 before its CPU kernel; float experts) keep the registry's moe_matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hetero.config import RuntimeConfig
from hetero.gguf_loader import GGUFTensor
from hetero.kernels.cpu_qdot_moe import (
    PackedExperts,
    grouped_matmul,
    pack_experts,
    route,
    runs_natively,
)


def runs_on_qdot(rt: RuntimeConfig, tensors: list[GGUFTensor]) -> bool:
    """Whether experts of these tensors run here on the qdot kernels: a CPU in "qdot" mode
    ("auto" there, where the kernels build) and every tensor of a type the kernel reads."""
    if not rt.device.startswith("cpu") or rt.weights_for(rt.device) not in ("auto", "qdot"):
        return False
    return rt.weights_mode() == "qdot" and all(runs_natively(t.ggml_type) for t in tensors)


class QdotExperts(nn.Module):
    """Gate, up and down expert tensors packed for qdot (+ float32 biases [E, N])."""

    def __init__(self, weights: list[GGUFTensor], biases: list[torch.Tensor | None]):
        super().__init__()
        self.gate, self.up, self.down = (
            pack_experts(t.torch(), t.ggml_type, tuple(t.shape)) for t in weights
        )
        self.biases = [None if b is None else b.float() for b in biases]
        self.n_experts = self.gate.n_experts

    def _matmuls(self, x: torch.Tensor, ws: list[PackedExperts], r, gather: bool):
        if len({w.ggml_type for w in ws}) == 1:  # one quantization of x, one pool job
            return grouped_matmul(x, ws, r, gather)
        return [grouped_matmul(x, [w], r, gather)[0] for w in ws]

    def _bias(self, y: torch.Tensor, i: int, expert_of: torch.Tensor) -> torch.Tensor:
        b = self.biases[i]
        return y if b is None else y + b[expert_of]

    def forward(
        self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act: Callable
    ) -> torch.Tensor:
        """h [T, C], ids [T, k], w [T, k] -> [T, C] float32; act(gate, up) [S, F] -> [S, F]."""
        t, k = ids.shape
        r = route(ids, self.n_experts)
        gate, up = self._matmuls(h.float(), [self.gate, self.up], r, gather=True)
        a = act(self._bias(gate, 0, r.expert_of), self._bias(up, 1, r.expert_of))
        (down,) = grouped_matmul(a.contiguous(), [self.down], r, gather=False)
        o = torch.empty_like(down)
        o[r.order] = self._bias(down, 2, r.expert_of)  # back to slot order (t, j)
        return (o.view(t, k, -1) * w.float()[..., None]).sum(1)
