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
    # how d is stored: "f16" at d_offset; "e8m0": MXFP4's exponent byte (d = 2^(e - 128));
    # "iq1m": IQ1_M's fp16 scattered over the top nibbles of its four scale words
    encoding: str = "f16"


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
    _T.IQ4_NL: _Scales(0, 3e-4),  # d * value, values -127 .. 113
    _T.IQ4_XS: _Scales(0, 1.5e-5),  # d * (ls - 32) * value
    _T.MXFP4: _Scales(0, 2**-8, encoding="e8m0"),  # d * doubled E2M1 (0 .. 12)
    # grid i-quants: d * (group scale) * (grid value) * sign
    _T.IQ2_XXS: _Scales(0, 3.6e-4),
    _T.IQ2_XS: _Scales(0, 3.6e-4),
    _T.IQ2_S: _Scales(0, 3.6e-4),
    _T.IQ3_XXS: _Scales(0, 1.7e-4),
    _T.IQ3_S: _Scales(0, 1.5e-4),
    _T.IQ1_S: _Scales(0, 3e-3),
    _T.IQ1_M: _Scales(48, 3e-3, encoding="iq1m"),
}


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n uniformly random bytes, drawn 8 at a time (the fastest path through the generator)."""
    words = rng.integers(0, 2**64, size=(n + 7) // 8, dtype=np.uint64, endpoint=False)
    return words.view(np.uint8)[:n]


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _put_scale(blocks: np.ndarray, spec: _Scales, d: np.ndarray) -> None:
    if spec.encoding == "e8m0":  # the nearest power of two: e = round(log2 d) + 128
        blocks[:, spec.d_offset] = (np.rint(np.log2(d)) + 128).astype(np.uint8)
    elif spec.encoding == "iq1m":  # fp16 bits 4k .. 4k+3 in the top nibble of scale word k
        bits = d.astype(np.float16).view(np.uint16).astype(np.uint16)
        words = blocks[:, spec.d_offset : spec.d_offset + 8].copy().view(np.uint16)
        for k in range(4):
            nibble = (bits >> np.uint16(4 * k)) & np.uint16(0xF)
            words[:, k] = (words[:, k] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
        blocks[:, spec.d_offset : spec.d_offset + 8] = words.view(np.uint8)
    else:
        _put_f16(blocks, spec.d_offset, d)


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
    _put_scale(blocks, spec, d)
    if spec.min_offset is not None:
        ratio = rng.uniform(0.8, 1.2, n_blocks).astype(np.float32) * np.float32(spec.min_ratio)
        _put_f16(blocks, spec.min_offset, d * ratio)
    return blocks
