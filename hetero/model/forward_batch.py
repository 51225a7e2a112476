"""Per-step metadata passed explicitly to the model (never a module global).

The model computes q/k/v and hands them to `batch.attention`, an attention backend that owns the
KV storage (contiguous for one sequence here; paged for the engine) and the step's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v [T, KV, D] of the new tokens, attend q [T, H, D]; returns [T, H, D].

        window > 0: each query sees only itself and the window - 1 keys before it; sinks [H]:
        a logit per head that joins the softmax without a value (kernels/paged_sinks.py).

        A backend may also have `rope_attend(layer, q, k, v, cos, sin, style, quant=None)`: q
        and k not yet rotated, the rotation fused with its KV write (None where it does not
        fuse them: the model rotates and calls the backend); quant, the layout in which the
        output projection reads its input pre-quantized: the output as QuantizedRows where the
        attention's launch makes them."""
        ...


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    logits_indices: torch.Tensor | slice  # [N] int64 (or a slice): rows whose logits are wanted
    attention: AttentionBackend
