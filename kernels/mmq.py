"""The integer tensor-core matmul of quantized weights against 8-bit activations (llama.cpp's
MMQ idea): for steps of a few rows per weight, where the tensor-core matmul on weights decoded
to bf16 spends its time decoding and converting, not reading.

    activations   x [R, K] -> int8 codes in blocks of 32 (q8_rows): x ~ s q, s = amax / 127,
                  with s sum(q) per block (llama.cpp's q8_1)
    weights       the packed K-quant planes (kernels/repack.py) as they are: a chunk of 32 codes
                  is one int8 [BN, 32] tile, its groups' scales (and mins) applied to the int32
                  sums, never to the codes

So the dot runs on int8 tensor cores and the weights are never decoded to floats. The 8-bit
activations round each x by up to s / 2 (as llama.cpp's MMQ and its CPU q8_K path do); the
float kernels stay exact to bf16's rounding of the decoded weights. Where it runs: the grouped
MoE matmul's sorted blocks (kernels/triton_moe.py, `MMQ`), the K-quants of 4 low bits (Q4_K,
Q5_K, Q6_K) with 16-bit activations; `mmq_linear` runs a dense weight as one expert (measured
against the dense kernels by benchmarks/gpu_mmq.py).
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.kernels.repack import PackedWeight

BLOCK = 32  # activations a scale
BN = 64  # weight rows a program
STEP = 8  # chunks of 32 codes a step (one batched dot; at most a super-block of 256)


def q8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [R, K], s float32 [R, K/32], s sum(q) float32 [R, K/32]) of x [R, K]: q =
    round(x / s) half away from zero, s = amax / 127 over each block of 32 (q8_rows_kernel's
    operations in its order)."""
    r, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    xb = x.float().reshape(r, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    a = torch.floor(xb.abs() * inv[..., None] + 0.5)
    q = torch.where(xb < 0, -a, a)
    s = amax / 127.0
    return q.to(torch.int8).reshape(r, k), s, s * q.sum(-1)


def q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`q8_rows_ref` in one launch (x [R, K] with unit stride along K)."""
    r, k = x.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    nb = k // BLOCK
    q = torch.empty(r, k, dtype=torch.int8, device=x.device)
    s = torch.empty(r, nb, dtype=torch.float32, device=x.device)
    sums = torch.empty_like(s)
    if r:
        bb = 16
        _kernels().q8_rows_kernel[(r, -(-nb // bb))](
            x, q, s, sums, nb, x.stride(0), q.stride(0), s.stride(0), BB=bb, num_warps=2
        )
    return q, s, sums


def mmq_ok(pw: PackedWeight, dtype: torch.dtype) -> bool:
    """Whether `moe_mmq` runs this weight with activations of `dtype`: a K-quant of 4 low bits
    (Q4_K, Q5_K, Q6_K) whose high plane (if any) is in the "fields" arrangement, 16-bit
    activations (float32 ones keep the float kernels' rounding)."""
    s = pw.spec
    return (
        dtype in (torch.bfloat16, torch.float16)
        and s.kquant
        and s.low_bits == 4
        and not s.packed_min
        and not s.codebook
        and (not s.high_bits or pw.high_layout == "fields")
        and pw.shape[1] % 256 == 0
    )


def moe_mmq(
    x: torch.Tensor, pw: PackedWeight, n: int, x_div: int, y: torch.Tensor,
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, bt: int, n_slots: int,
) -> torch.Tensor:  # fmt: skip
    """y [S, N] of the sorted slot blocks (kernels/triton_moe.py's layout): slot s reads x row
    s // x_div and its expert's rows of the packed [E * N, K] weight."""
    k = x.shape[-1]
    xq, sx, sums = q8_rows(x)
    s = pw.spec
    grid = (expert_ids.shape[0], -(-n // BN))
    _kernels().moe_mmq_kernel[grid](
        xq, sx, sums, y, sorted_ids, expert_ids, *_planes(pw),
        n, k // BLOCK, n_slots, x_div, xq.stride(0), sx.stride(0), y.stride(0),
        pw.codes.stride(0), pw.scale.stride(0), pw.d.stride(0),
        HB=s.high_bits, G=s.group, OFF=s.offset, HAS_MIN=s.has_min, BN=BN, BT=bt, S=STEP,
        num_warps=4,
    )  # fmt: skip
    return y


def mmq_linear(x: torch.Tensor, pw: PackedWeight, bt: int = 16) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T through `moe_mmq_kernel`, W one expert: the T rows in blocks
    of bt (each block reads the weight again: adjacent programs, so mostly from L2)."""
    t, n = x.shape[0], pw.shape[0]
    blocks = max(1, -(-t // bt))
    sorted_ids = torch.arange(blocks * bt, dtype=torch.int32, device=x.device)
    sorted_ids = torch.where(sorted_ids < t, sorted_ids, t)
    expert_ids = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    return moe_mmq(x, pw, n, 1, y, sorted_ids, expert_ids, bt, t)


def _planes(pw: PackedWeight) -> list[torch.Tensor]:
    """codes, high, scale, min, d, dmin (an absent plane: codes, never read)."""
    return [
        pw.codes if p is None else p for p in (pw.codes, pw.high, pw.scale, pw.minv, pw.d, pw.dmin)
    ]


def _kernels() -> Any:
    from hetero.kernels import triton_mmq_kernels  # imports triton: first use only

    return triton_mmq_kernels
