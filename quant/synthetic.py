"""Random but finite GGUF blocks, for synthetic benchmark models and tests.

Quantized codes are integers, so any byte pattern decodes to finite values except in the fp16
scale fields. `random_blocks` draws all bytes in bulk, then overwrites only those fields with
modest positive scales chosen so the decoded weights have roughly the spread of a trained model's
(std ~0.02-0.05). Mins are tied to their block's scale so the values stay roughly centred.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from .registry import get_quant

_T = GGMLQuantizationType
WEIGHT_STD = 0.02  # for the unquantized types: N(0, WEIGHT_STD)


@dataclass(frozen=True)
class _Scales:
    d_offset: int
    d: float  # centre of the super-scale; each block draws d * U(0.5, 1.5)
    min_offset: int | None = None
    min_ratio: float = 0.0  # min field = d * min_ratio * U(0.8, 1.2) (sign included)


# d is set from the spread of the codes times sub-block scales, so that d * typical product
# ~ 0.02: e.g. Q4_K decodes d * sc * q with sc ~ U(0, 63), q ~ U(0, 15).
_SCALES: dict[GGMLQuantizationType, _Scales] = {
    _T.Q4_0: _Scales(0, 4e-3),
    _T.Q4_1: _Scales(0, 4e-3, 2, -7.5),  # x = d*q + m with q in 0..15: centre at q = 7.5
    _T.Q5_0: _Scales(0, 2e-3),
    _T.Q5_1: _Scales(0, 2e-3, 2, -15.5),
    _T.Q8_0: _Scales(0, 2.5e-4),
    _T.Q2_K: _Scales(80, 1.5e-3, 82, 1.5),  # x = d*sc*q - dmin*m
    _T.Q3_K: _Scales(108, 5e-4),
    _T.Q4_K: _Scales(0, 8e-5, 2, 7.5),
    _T.Q5_K: _Scales(0, 4e-5, 2, 15.5),
    _T.Q6_K: _Scales(208, 1.5e-5),
}


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n uniformly random bytes, drawn 8 at a time (the fastest path through the generator)."""
    words = rng.integers(0, 2**64, size=(n + 7) // 8, dtype=np.uint64, endpoint=False)
    return words.view(np.uint8)[:n]


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(
    ggml_type: GGMLQuantizationType | int | str, n_blocks: int, rng: np.random.Generator
) -> np.ndarray:
    """(n_blocks, type_size) uint8 of random blocks whose every decoded value is finite."""
    qt = get_quant(ggml_type)
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    if qt.block_size == 1:  # float types: encode normal weights
        assert qt.quantize is not None
        values = rng.standard_normal(n_blocks, dtype=np.float32) * np.float32(WEIGHT_STD)
        return qt.quantize(values).reshape(n_blocks, qt.type_size)
    spec = _SCALES.get(qt.ggml_type)
    if spec is None:
        raise ValueError(f"no random block recipe for {qt.name}")
    blocks = _random_bytes(n_blocks * qt.type_size, rng).reshape(n_blocks, qt.type_size)
    d = rng.uniform(0.5, 1.5, n_blocks).astype(np.float32) * np.float32(spec.d)
    _put_f16(blocks, spec.d_offset, d)
    if spec.min_offset is not None:
        ratio = rng.uniform(0.8, 1.2, n_blocks).astype(np.float32) * np.float32(spec.min_ratio)
        _put_f16(blocks, spec.min_offset, d * ratio)
    return blocks
