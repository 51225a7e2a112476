"""The CPU's qdot packing dequantized on a GPU, rows at a time, in one launch.

A prompt step that runs a CPU layer's matmuls on the GPU (execution/offload.py) copies the CPU
kernels' own bytes (kernels/cpu_qdot.py: rows in groups of 16, each unit of 16 rows x one GGUF
block with its fields side by side) into a staging buffer there. For a prompt-sized T the product
is a dense one: W's rows in bf16, then cuBLAS. This kernel writes those rows straight from the
staged bytes, where the general path turns them back into GGUF blocks, repacks them into the
GPU kernels' planes (some twenty torch passes over the weight) and dequantizes the planes: one
pass instead, and no scratch but the rows it writes.

    dequant_rows(packed, ggml_type, n, k, start, stop, dtype) -> W[start:stop] [stop - start, k]

`packed` is the QdotWeight's uint8 [groups, k / block, 16 * type_size] on the device; start is a
multiple of 16 (a row group). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (`supports`);
float32 output is the reference's dequantization bit for bit, bf16 / fp16 that rounded to
nearest even, as torch's .to() rounds it.
"""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType

from hetero.kernels.cpu_qdot import GROUP, qdot_blocks
from hetero.quant import get_quant

_T = GGMLQuantizationType
SUPPORTED = (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K)


def _kernels() -> Any:
    from hetero.kernels import triton_qdot_dequant_kernels  # imports triton: first use only

    return triton_qdot_dequant_kernels


def supports(ggml_type) -> bool:
    """Whether the kernel decodes this GGUF type (a type, its number or its name)."""
    return qdot_blocks(ggml_type) in {t.name for t in SUPPORTED}


def dequant_rows(
    packed: torch.Tensor, ggml_type, n: int, k: int, start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows [start, stop) of the W [n, k] that `packed` holds, as a dense [stop - start, k]
    tensor of `dtype` on packed's device."""
    if not supports(ggml_type):
        raise ValueError(f"{_T(int(ggml_type)).name}: no GPU decode of the qdot packing")
    qt = get_quant(_T(int(ggml_type)))
    units = k // qt.block_size
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (
        -(-n // GROUP), units, GROUP * qt.type_size,
    ):  # fmt: skip
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype} is no qdot {qt.name} "
                         f"[{n}, {k}]")  # fmt: skip
    if start % GROUP or not 0 <= start <= stop <= n:
        raise ValueError(f"rows [{start}, {stop}) of {n}: start must be a multiple of {GROUP}")
    out = torch.empty(stop - start, k, dtype=dtype, device=packed.device)
    if stop == start:
        return out
    flat = packed.contiguous().reshape(-1)
    ub = 1 if qt.block_size == 256 else 8  # units a program: 256 columns either way
    g0 = start // GROUP
    grid = (-(-stop // GROUP) - g0, -(-units // ub))
    _kernels().qdot_dequant_kernel[grid](
        out, flat, flat.view(torch.int16), flat.view(torch.int32), stop, units, out.stride(0),
        g0, TYPE=int(qt.ggml_type), UNIT=GROUP * qt.type_size, UB=ub, num_warps=4,
    )  # fmt: skip
    return out
