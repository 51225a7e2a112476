"""What a loaded model holds where: a StageLayout per device, and the bytes of its weights.

The status page draws the model as it runs from these (the planner's StagePlan, drawn the same
way, is what was predicted): each device's layers, weights mode, kernels, and the memory its
weights and KV pool take.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.engine.executor import StageLayout

# the ops a layout names (the planner's StagePlan.kernels names the same ones)
LAYOUT_OPS = ("qlinear", "paged_attention", "kv_write")
# the CPU's packed weights modes run kernels/cpu_linear.py's scheme of that name
CPU_PACKED = ("qdot", "int4", "int8", "fp16", "bf16")


def kernels_on(device: str, weights: str) -> dict[str, str]:
    """op -> the implementation that runs it on `device` in weights mode `weights`: the
    registry's choice, except linears the weights mode runs itself (dense: torch's matmul;
    the CPU's packed modes: cpu_linear's scheme)."""
    from hetero.kernels import registry

    out = {op: registry.select(op, device).name for op in LAYOUT_OPS if op in registry.ops()}
    if weights == "dense":
        out["qlinear"] = "torch dense"
    elif weights in CPU_PACKED:
        out["qlinear"] = f"cpu_linear {weights}"
    return out


def tensor_bytes(holder: nn.Module | object) -> int:
    """Bytes of every tensor `holder` holds: a module's parameters, buffers and the plain
    attributes the quantized layers keep their packed weights in (over all its submodules), or
    an object's tensor attributes (a KV pool); each storage counted once: a tied head shares
    the embedding's."""
    seen: set[int] = set()
    total = 0
    parts = holder.modules() if isinstance(holder, nn.Module) else [holder]
    for m in parts:
        values = list(vars(m).values())
        if isinstance(m, nn.Module):
            values += [*m._parameters.values(), *m._buffers.values()]
        for t in _tensors(values):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and t.device.type != "meta":
                seen.add(key)
                total += storage.nbytes()
    return total


def _tensors(values) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(v)
    return out


def segment_layout(segment) -> StageLayout:
    """One local segment (execution/segment.py) as loaded."""
    model, size = segment.model, segment.size
    device = str(model.runtime.device)
    weights = model.runtime.weights_mode()
    return StageLayout(
        device=device,
        layer_start=model.layer_range.start,
        layer_end=model.layer_range.stop,
        weights=weights,
        kernels=kernels_on(device, weights),
        kv_dtype=segment.kv_dtype,
        num_kv_blocks=size.num_blocks,
        kv_bytes=tensor_bytes(segment.pool),
        weight_bytes=tensor_bytes(model),
    )
