"""The registry of GGUF element types the project can read and write.

A `QuantType` bundles a block format's geometry with its torch dequantizer (the bit-exact reference
every GPU kernel is tested against) and its numpy quantizer. Tests walk `supported_types()`, so a
type is tested by being registered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import codebooks, floats, iq4_quantize, iquants, kquantize, kquants, legacy

_T = GGMLQuantizationType


class UnsupportedTensorType(ValueError):
    """A GGUF element type with no dequantizer here (TQ*, NVFP4, integer types ...)."""


@dataclass(frozen=True)
class QuantType:
    ggml_type: GGMLQuantizationType
    name: str  # the ggml name, e.g. "Q4_K"
    block_size: int  # elements per block: 32 or 256; 1 for float types
    type_size: int  # bytes per block
    # (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32, on the input's device
    dequant: Callable[[torch.Tensor], torch.Tensor]
    # float32 (..., n) -> uint8 (..., n // block_size * type_size); None where we cannot write it
    quantize: Callable[[np.ndarray], np.ndarray] | None
    # byte offsets of the fp16 fields (scales, mins) inside a block: the only bytes whose random
    # values can be non-finite (inf/nan), so random test blocks mask exactly these
    f16_offsets: tuple[int, ...] = ()

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_size:
            raise ValueError(
                f"{self.name} rows must hold a multiple of {self.block_size} elements, got {n_cols}"
            )
        return n_cols // self.block_size * self.type_size


_REGISTRY: dict[GGMLQuantizationType, QuantType] = {}


def register(
    ggml_type: GGMLQuantizationType,
    dequant: Callable[[torch.Tensor], torch.Tensor],
    quantize: Callable[[np.ndarray], np.ndarray] | None,
    f16_offsets: tuple[int, ...] = (),
) -> QuantType:
    if ggml_type in _REGISTRY:
        raise ValueError(f"{ggml_type.name} is already registered")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    qt = QuantType(ggml_type, ggml_type.name, block_size, type_size, dequant, quantize, f16_offsets)
    _REGISTRY[ggml_type] = qt
    return qt


register(_T.F32, floats.dequant_f32, floats.quantize_f32)
register(_T.F16, floats.dequant_f16, floats.quantize_f16, (0,))
register(_T.BF16, floats.dequant_bf16, floats.quantize_bf16)
register(_T.Q4_0, legacy.dequant_q4_0, legacy.gguf_quantizer(_T.Q4_0), (0,))
register(_T.Q4_1, legacy.dequant_q4_1, legacy.gguf_quantizer(_T.Q4_1), (0, 2))
register(_T.Q5_0, legacy.dequant_q5_0, legacy.gguf_quantizer(_T.Q5_0), (0,))
register(_T.Q5_1, legacy.dequant_q5_1, legacy.gguf_quantizer(_T.Q5_1), (0, 2))
register(_T.Q8_0, legacy.dequant_q8_0, legacy.gguf_quantizer(_T.Q8_0), (0,))
register(_T.Q2_K, kquants.dequant_q2_k, kquantize.quantize_q2_k, (80, 82))
register(_T.Q3_K, kquants.dequant_q3_k, kquantize.quantize_q3_k, (108,))
register(_T.Q4_K, kquants.dequant_q4_k, kquantize.quantize_q4_k, (0, 2))
register(_T.Q5_K, kquants.dequant_q5_k, kquantize.quantize_q5_k, (0, 2))
register(_T.Q6_K, kquants.dequant_q6_k, kquantize.quantize_q6_k, (208,))
register(_T.IQ4_NL, codebooks.dequant_iq4_nl, iq4_quantize.quantize_iq4_nl, (0,))
register(_T.IQ4_XS, codebooks.dequant_iq4_xs, iq4_quantize.quantize_iq4_xs, (0,))
register(_T.MXFP4, codebooks.dequant_mxfp4, legacy.gguf_quantizer(_T.MXFP4))
register(_T.IQ2_XXS, iquants.dequant_iq2_xxs, None, (0,))
register(_T.IQ2_XS, iquants.dequant_iq2_xs, None, (0,))
register(_T.IQ2_S, iquants.dequant_iq2_s, None, (0,))
register(_T.IQ3_XXS, iquants.dequant_iq3_xxs, None, (0,))
register(_T.IQ3_S, iquants.dequant_iq3_s, None, (0,))
register(_T.IQ1_S, iquants.dequant_iq1_s, None, (0,))
register(_T.IQ1_M, iquants.dequant_iq1_m, None)  # its fp16 d is split into nibbles (iquants)


def supported_types() -> list[QuantType]:
    return sorted(_REGISTRY.values(), key=lambda q: int(q.ggml_type))


def _supported_names() -> str:
    return ", ".join(q.name for q in supported_types())


def get_quant(t: GGMLQuantizationType | int | str) -> QuantType:
    """Look a type up by enum, ggml id (e.g. 12) or name (e.g. "q4_k", case-insensitive)."""
    try:
        if isinstance(t, str):
            ggml_type = GGMLQuantizationType[t.strip().upper()]
        else:
            ggml_type = GGMLQuantizationType(int(t))
    except (KeyError, ValueError):
        raise UnsupportedTensorType(
            f"unknown GGUF tensor type {t!r}; supported: {_supported_names()}"
        ) from None
    qt = _REGISTRY.get(ggml_type)
    if qt is None:
        raise UnsupportedTensorType(
            f"GGUF tensor type {ggml_type.name} is not supported yet; "
            f"supported: {_supported_names()}"
        )
    return qt


def row_bytes(ggml_type: GGMLQuantizationType | int | str, n_cols: int) -> int:
    return get_quant(ggml_type).row_bytes(n_cols)


def _typed_float(data: torch.Tensor, qt: QuantType) -> torch.Tensor | None:
    """F32/F16 tensors as GGUFReader types them (not raw bytes): convert directly."""
    if qt.ggml_type == _T.F32 and data.dtype == torch.float32:
        return data.clone()  # never hand out an alias of a read-only file mapping
    if qt.ggml_type == _T.F16 and data.dtype == torch.float16:
        return data.to(torch.float32)
    return None


def dequantize(
    data: torch.Tensor, ggml_type: GGMLQuantizationType | int | str, shape: tuple[int, ...]
) -> torch.Tensor:
    """GGUF tensor data -> float32 tensor of the logical (numpy-order) `shape`, on data's device.

    `data` is what GGUFReader gives as torch: uint8 bytes (..., bytes_per_row) for quantized types
    and BF16, float16/float32 elements for F16/F32 (raw uint8 bytes are accepted for those too).
    """
    qt = get_quant(ggml_type)
    shape = tuple(int(s) for s in shape)
    n_elems = math.prod(shape)
    if not shape or shape[-1] % qt.block_size:
        raise ValueError(f"{qt.name}: shape {shape} rows are not whole {qt.block_size}-blocks")
    direct = _typed_float(data, qt)
    if direct is not None:
        if direct.numel() != n_elems:
            raise ValueError(f"{qt.name}: {data.numel()} elements cannot have shape {shape}")
        return direct.reshape(shape)
    if data.dtype != torch.uint8:
        raise ValueError(f"{qt.name} data must be uint8 bytes, got {data.dtype}")
    n_blocks = n_elems // qt.block_size
    if data.numel() != n_blocks * qt.type_size:
        raise ValueError(
            f"{qt.name}: {data.numel()} bytes do not hold shape {shape} "
            f"({n_blocks} blocks of {qt.type_size} bytes)"
        )
    return _dequant_blocks(qt, data.reshape(n_blocks, qt.type_size)).reshape(shape)


# Elements per CPU work item (4 MiB of float32): intermediates of this size come from the
# allocator's free lists and stay in cache, while one-shot allocations of hundreds of MB cost more
# in page faults than the arithmetic; so on CPU only the output is allocated at full size. Measured
# on 2 cores, 50M elements: 2^18 -> 92-216 ms, 2^20 -> 78-185 ms, 2^22 -> 75-169 ms, one pass
# about twice as slow. GPUs take one pass.
_CPU_CHUNK_ELEMENTS = 1 << 20


def _dequant_blocks(qt: QuantType, blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    step = max(1, _CPU_CHUNK_ELEMENTS // qt.block_size)
    if blocks.device.type != "cpu" or n_blocks <= step:
        return qt.dequant(blocks)
    out = torch.empty(n_blocks, qt.block_size, dtype=torch.float32)
    for start in range(0, n_blocks, step):
        out[start : start + step] = qt.dequant(blocks[start : start + step])
    return out


def quantize(x: np.ndarray, ggml_type: GGMLQuantizationType | int | str) -> np.ndarray:
    """float32 (..., n) -> uint8 (..., n // block_size * type_size), the GGUF bytes of `x`."""
    qt = get_quant(ggml_type)
    if qt.quantize is None:
        raise UnsupportedTensorType(f"quantizing to {qt.name} is not supported yet")
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % qt.block_size:
        raise ValueError(
            f"{qt.name}: rows of shape {x.shape} are not whole {qt.block_size}-element blocks"
        )
    if x.size == 0:
        return np.empty((*x.shape[:-1], qt.row_bytes(x.shape[-1])), dtype=np.uint8)
    if qt.block_size > 1 and not np.all(np.isfinite(x)):
        raise ValueError(f"{qt.name}: cannot quantize non-finite values (inf/nan)")
    out = qt.quantize(x.astype(np.float32, copy=False))
    return out.reshape(*x.shape[:-1], qt.row_bytes(x.shape[-1]))
