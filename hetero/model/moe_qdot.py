"""A layer's experts on the CPU's qdot kernels: the expert layer of model/moe.py when its experts
run on a CPU in "qdot" weights mode (what "auto" means there), one native call a layer
(kernels/cpu_moe_layer.py):

    h [T, C], ids [T, k], w [T, k]  (or the router's, where it runs on this CPU too)
    slots sorted by expert                                           S = T * k
    gate, up = grouped(h, Wg, Wu)   one quantization of h, one job   [S, F] each, sorted order
    a = act(gate (+ bg), up (+ bu))                                  [S, F]
    o = grouped(a, Wd) (+ bd)                                        [S, C], sorted order
    out[t] = sum_j w[t, j] o[slot (t, j)]                            [T, C]

Each expert tensor is packed once at load (its GGUF bytes moved, none changed, as the dense
qdot linears'); a call reads only the chosen experts' byte ranges. Layers whose expert types the
kernel table lacks (float experts) keep the registry's moe_matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from hetero.config import RuntimeConfig
from hetero.gguf_loader import GGUFTensor
from hetero.kernels import host_hop
from hetero.kernels.cpu_moe_layer import MoeLayer, RouterWeights, moe_layer
from hetero.kernels.cpu_qdot_moe import PackedExperts, pack_experts, runs_natively


def runs_on_qdot(rt: RuntimeConfig, tensors: list[GGUFTensor]) -> bool:
    """Whether experts of these tensors run here on the qdot kernels: a CPU in "qdot" mode
    ("auto" there, where the kernels build) and every tensor of a type the kernel reads."""
    if not rt.device.startswith("cpu") or rt.weights_for(rt.device) not in ("auto", "qdot"):
        return False
    return rt.weights_mode() == "qdot" and all(runs_natively(t.ggml_type) for t in tensors)


class QdotExperts(nn.Module):
    """Gate, up and down expert tensors packed for qdot (+ float32 biases [E, N])."""

    def __init__(
        self, weights: list[GGUFTensor], biases: list[torch.Tensor | None], activation: str
    ):
        super().__init__()
        gate, up, down = (pack_experts(t.torch(), t.ggml_type, tuple(t.shape)) for t in weights)
        fp32 = tuple(None if b is None else b.float().contiguous() for b in biases)
        self.layer = MoeLayer(gate, up, down, fp32, activation)  # type: ignore[arg-type]
        self.routed: MoeLayer | None = None  # the layer with its router (take_router)
        self.n_experts = gate.n_experts

    @property
    def parts(self) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        return self.layer.gate, self.layer.up, self.layer.down

    def pin_memory(self) -> int:
        """Move the packed experts into pinned memory (a GPU copies them from there without a
        bounce through pageable pages), where the native call then reads them; the bytes."""
        for p in self.parts:
            p.packed = p.packed.pin_memory()
        self.layer = dataclasses.replace(self.layer)  # the native call's pointers, taken again
        if self.routed is not None:
            self.routed = dataclasses.replace(self.routed)
        return sum(p.packed.nbytes for p in self.parts)

    def take_router(
        self, weight: torch.Tensor, bias, gating: str, k: int, norm: bool
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The layer with its router (float32 weight [E, C] + bias [E], on this CPU) in the
        same native call: h [T, C] -> [T, C] float32."""
        router = RouterWeights(weight.detach().contiguous(), bias, gating, k, norm)
        self.routed = dataclasses.replace(self.layer, router=router)
        return self._routed_call

    def _routed_call(self, h: torch.Tensor) -> torch.Tensor:
        """The routed layer of h [T, C]: where h is on a GPU, one hop to this CPU and back, a
        host node of the graph that captures it (kernels/host_hop.py); eagerly a copy there and
        back, which also reserves the pinned room of the capture that may follow."""
        layer = self.routed
        assert layer is not None
        if not h.is_cuda:
            return moe_layer(layer, h.float())[0].to(h.dtype)
        if host_hop.capturing(h):
            return host_hop.run_on_host(h, layer.hop_fn(), layer.hop).to(h.dtype)
        host_hop.reserve(h.device, h.shape[1], h.shape[0])
        return moe_layer(layer, h.to("cpu", torch.float32))[0].to(h.device, h.dtype)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h [T, C], ids [T, k], w [T, k] -> [T, C] float32."""
        return moe_layer(self.layer, h.float(), ids, w)[0]
