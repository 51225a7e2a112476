"""Programmatic dependent launch (sm_90+) for the small kernels of a decode step.

A decode step is ~500 kernels, most of them tiny (a norm, a rotation, a KV write, an
attention split and its reduce, an activation's quantization): each waited for the one before
it to drain, then for its own launch, ~0.9 us a launch between kernels of the H200's dense 8B
step (ninth session: 3.97 ms replayed, 3.50 ms of it in kernels). Launched with
programmatic stream serialization (`launch_pdl`), a kernel's programs start while the one
before finishes and wait for it (`griddepcontrol.wait`, Triton's gdc_wait) before touching
memory; they then let the next kernel launch (gdc_launch_dependents). Every such kernel waits,
even one that reads nothing of its predecessor's, so that kernel N+2 never overtakes N: the
wait is the kernel's first statement (`triton_pdl.pdl_wait`), ahead of any load or store (a
buffer the allocator hands out again may still be read by the kernel before).

Off until measured on the GPU machine: `HETERO_PDL=1` turns it on (the Stream-K GEMVs keep
their tuning table's choice either way, `streamk.StreamKConfig.pdl`). CUDA before sm_90 and
Triton's interpreter have no such launch.
"""

from __future__ import annotations

import os

import torch


def pdl_supported(device: torch.device | str) -> bool:
    """Whether `device` can launch kernels programmatically (griddepcontrol: sm_90 and later,
    compiled kernels; the Stream-K GEMVs ask this for their tuning table's `pdl`)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_ok(device: torch.device | str) -> bool:
    """Whether the small kernels on `device` launch programmatically (HETERO_PDL=1 asks)."""
    return os.environ.get("HETERO_PDL", "0") == "1" and pdl_supported(device)


def pdl_launch(device: torch.device | str) -> dict:
    """The launch's keyword arguments: PDL (the kernels' constexpr) and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if pdl_ok(device) else {}
