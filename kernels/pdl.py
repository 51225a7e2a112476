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

On by default for steps of at most `PDL_MAX_ROWS` rows. Measured on the H200 (thirteenth session,
`benchmarks/gpu_engine.py` on the dense 8B Q4_K_M, HETERO_PDL=0 against =1 in one call): decode
at 1 stream 256 -> 280 tok/s, at 16 streams 2,138 -> 2,068 aggregate, at 64 5,725 -> 5,566 (the
early-launched programs wait beside the larger steps' kernels); between 1 and 16 not yet
measured. `HETERO_PDL=0` turns it off, `HETERO_PDL=1` on at every size (the Stream-K GEMVs keep
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


# Steps of more rows launch plainly (HETERO_PDL unset): one stream's decode, and its verify steps
# of 1 + k guessed rows (k <= 7), gain; 16 streams lose
PDL_MAX_ROWS = 8


def pdl_ok(device: torch.device | str, rows: int = 1) -> bool:
    """Whether a small kernel over `rows` rows (tokens) on `device` launches programmatically:
    HETERO_PDL=0 never, =1 always, unset up to PDL_MAX_ROWS rows."""
    flag = os.environ.get("HETERO_PDL", "")
    if flag == "0" or not pdl_supported(device):
        return False
    return flag == "1" or rows <= PDL_MAX_ROWS


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch's keyword arguments for a kernel over `t` (its device, rows = its first
    dimension): PDL (the kernels' constexpr) and Triton's launch_pdl."""
    rows = t.shape[0] if t.dim() else 1
    return {"PDL": True, "launch_pdl": True} if pdl_ok(t.device, rows) else {}
