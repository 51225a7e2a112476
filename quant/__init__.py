"""GGUF block formats: bit-exact torch dequantizers, numpy quantizers, random blocks.

from hetero.quant import dequantize, quantize, get_quant

w = dequantize(to_torch(reader_tensor.data), reader_tensor.tensor_type, shape)  # float32
raw = quantize(weights_f32, "q4_k")  # uint8 (..., row_bytes)
"""

from __future__ import annotations

from .bits import to_torch
from .registry import (
    QuantType,
    UnsupportedTensorType,
    dequantize,
    get_quant,
    quantize,
    row_bytes,
    supported_types,
)
from .synthetic import random_blocks

__all__ = [
    "QuantType",
    "UnsupportedTensorType",
    "dequantize",
    "get_quant",
    "quantize",
    "random_blocks",
    "row_bytes",
    "supported_types",
    "to_torch",
]
