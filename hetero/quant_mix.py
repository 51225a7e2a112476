"""Quantization mixes: which GGML type each tensor of a model gets, as llama.cpp's quantizer does.

A mix ("q4_k_m", "q8_0", ...) is a llama.cpp file type: a default tensor type plus per-tensor
rules (`llama_tensor_get_type` in llama-quant.cpp). `tensor_type_for` reproduces those rules for
dense llama-family models, so `hetero synth` and `hetero quantize` agree with `llama-quantize`:

- output.weight, and token_embd.weight when the embeddings are tied, take Q6_K (Q8_0 for the
  q8_0 mix, or when the row does not divide the default type's block);
- attn_v and ffn_down get more bits on the "use_more_bits" layers (first and last eighth, and
  every third layer between) in Q4_K_M / Q5_K_M, on the first layers in Q4_K_S, and so on;
- a row (ne0, the input features) that does not divide the chosen type's block falls back per
  tensor: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0, IQ4_XS -> IQ4_NL, and to
  F16 when even the fallback's 32-wide block does not divide (llama.cpp aborts for a few types);
- IQ4_NL / IQ4_XS (without an importance matrix): attn_v takes Q5_K when n_gqa >= 4, ffn_down
  Q5_K on the first eighth of the layers;
- MXFP4_MOE: expert tensors (3-D) MXFP4, every other weight Q8_0;
- "pure-TYPE" (e.g. pure-iq2_xxs, pure-mxfp4): every weight TYPE, falling back per tensor as
  above (IQ types of 256-element blocks to IQ4_NL), as `llama-quantize --pure` writes.

Left out: the MoE and 70B-specific bumps, the IQ1/IQ2/IQ3 mixes and the importance-matrix
variants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

T = GGMLQuantizationType


@dataclass(frozen=True)
class QuantMix:
    name: str
    file_type: LlamaFileType  # general.file_type
    default: GGMLQuantizationType  # type of every 2D weight no rule changes
    pure: bool = False  # no per-tensor rules: every weight `default` (or its fallback)


QUANT_MIXES: dict[str, QuantMix] = {
    m.name: m
    for m in (
        QuantMix("f32", LlamaFileType.ALL_F32, T.F32),
        QuantMix("f16", LlamaFileType.MOSTLY_F16, T.F16),
        QuantMix("bf16", LlamaFileType.MOSTLY_BF16, T.BF16),
        QuantMix("q4_0", LlamaFileType.MOSTLY_Q4_0, T.Q4_0),
        QuantMix("q4_1", LlamaFileType.MOSTLY_Q4_1, T.Q4_1),
        QuantMix("q5_0", LlamaFileType.MOSTLY_Q5_0, T.Q5_0),
        QuantMix("q5_1", LlamaFileType.MOSTLY_Q5_1, T.Q5_1),
        QuantMix("q8_0", LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
        QuantMix("q2_k", LlamaFileType.MOSTLY_Q2_K, T.Q2_K),
        QuantMix("q3_k_m", LlamaFileType.MOSTLY_Q3_K_M, T.Q3_K),
        QuantMix("q4_k_s", LlamaFileType.MOSTLY_Q4_K_S, T.Q4_K),
        QuantMix("q4_k_m", LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
        QuantMix("q5_k_s", LlamaFileType.MOSTLY_Q5_K_S, T.Q5_K),
        QuantMix("q5_k_m", LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
        QuantMix("q6_k", LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
        QuantMix("iq4_nl", LlamaFileType.MOSTLY_IQ4_NL, T.IQ4_NL),
        QuantMix("iq4_xs", LlamaFileType.MOSTLY_IQ4_XS, T.IQ4_XS),
        QuantMix("mxfp4_moe", LlamaFileType.MOSTLY_MXFP4_MOE, T.MXFP4),
    )
}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)

# llama.cpp's tensor_type_fallback for a row that does not divide the type's block.
FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    T.Q2_K: T.Q4_0,
    T.Q3_K: T.Q4_0,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
    T.IQ4_XS: T.IQ4_NL,
    **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S), T.IQ4_NL),
}
PURE_PREFIX = "pure-"

_LAYER = re.compile(r"^blk\.(\d+)\.")


def get_mix(mix: str) -> QuantMix:
    key = mix.lower()
    if key.startswith(PURE_PREFIX):
        return _pure_mix(key)
    if key not in QUANT_MIXES:
        raise ValueError(
            f"unknown quantization type {mix!r}; known: {', '.join(QUANT_MIXES)}, "
            f"and {PURE_PREFIX}TYPE for any supported GGUF type (e.g. {PURE_PREFIX}iq2_xxs)"
        )
    return QUANT_MIXES[key]


def _pure_mix(key: str) -> QuantMix:
    from hetero.quant import get_quant

    qtype = get_quant(key.removeprefix(PURE_PREFIX)).ggml_type  # refuses unknown types by name
    file_types = (f"MOSTLY_{qtype.name}", f"MOSTLY_{qtype.name}_M", f"MOSTLY_{qtype.name}_MOE")
    names = ("ALL_F32",) if qtype == T.F32 else file_types
    known = [LlamaFileType[n] for n in names if n in LlamaFileType.__members__]
    return QuantMix(key, known[0] if known else LlamaFileType.GUESSED, qtype, pure=True)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: first/last eighth and every third."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def is_quantizable(name: str, n_dims: int) -> bool:
    """llama.cpp quantizes 2D (and 3-D expert) `*.weight` tensors except norms and the MoE
    router `ffn_gate_inp` (1D tensors stay as they are)."""
    return (
        n_dims >= 2
        and name.endswith(".weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp" not in name
    )


def block_size(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def fallback_type(qtype: GGMLQuantizationType, n_cols: int) -> GGMLQuantizationType:
    """The type a row of `n_cols` can actually hold when `qtype`'s block does not divide it."""
    if n_cols % block_size(qtype) == 0:
        return qtype
    fallback = FALLBACK.get(qtype, T.F16)
    return fallback if n_cols % block_size(fallback) == 0 else T.F16


def tensor_type_for(
    name: str,
    n_cols: int,
    mix: str,
    layer: int | None,
    n_layers: int,
    *,
    n_dims: int = 2,
    tied_embeddings: bool = False,
    n_gqa: int = 1,
) -> GGMLQuantizationType:
    """The GGML type of tensor `name` (rows of `n_cols` input features) in a `mix` file.

    `layer` is the block index (parsed from "blk.N." when None); `tied_embeddings` says the
    file has no output.weight, so token_embd is also the output head; `n_gqa` is
    n_heads / n_kv_heads (Q2_K keeps attn_v at Q4_K when it is 4 or more).
    """
    m = get_mix(mix)
    if not is_quantizable(name, n_dims):
        return T.F32
    if m.default in FLOAT_TYPES:
        return m.default
    if m.pure:
        return fallback_type(m.default, n_cols)
    if layer is None and (match := _LAYER.match(name)):
        layer = int(match.group(1))
    is_output = name == "output.weight" or (tied_embeddings and name == "token_embd.weight")
    if is_output:
        qtype = _output_type(m, n_cols)
    elif m.name == "mxfp4_moe":
        qtype = T.MXFP4 if n_dims == 3 else T.Q8_0
    else:
        qtype = _layer_type(m, name, layer, n_layers, n_gqa)
    return fallback_type(qtype, n_cols)


def _output_type(m: QuantMix, n_cols: int) -> GGMLQuantizationType:
    if n_cols % block_size(m.default) != 0 or m.default in (T.Q8_0, T.MXFP4):
        return T.Q8_0
    return T.Q6_K


def _layer_type(
    m: QuantMix, name: str, layer: int | None, n_layers: int, n_gqa: int
) -> GGMLQuantizationType:
    """The per-category rules of llama_tensor_get_type_impl for the mixes we know."""
    if layer is None:
        return m.default  # token_embd (untied) and other tensors outside the blocks
    if "attn_v.weight" in name:
        return _attn_v_type(m, layer, n_layers, n_gqa)
    if "ffn_down" in name:
        return _ffn_down_type(m, layer, n_layers)
    if "attn_output.weight" in name:
        return {"q2_k": T.Q3_K, "q3_k_m": T.Q4_K}.get(m.name, m.default)
    return m.default


def _attn_v_type(m: QuantMix, layer: int, n_layers: int, n_gqa: int) -> GGMLQuantizationType:
    if m.name == "q2_k":
        return T.Q4_K if n_gqa >= 4 else T.Q3_K
    if m.name == "q3_k_m":
        return T.Q5_K if layer < 2 else T.Q4_K
    if m.name in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
        return T.Q6_K
    if m.name == "q4_k_s" and layer < 4:
        return T.Q5_K
    if m.name in ("iq4_nl", "iq4_xs") and n_gqa >= 4:
        return T.Q5_K
    return m.default


def _ffn_down_type(m: QuantMix, layer: int, n_layers: int) -> GGMLQuantizationType:
    if m.name == "q2_k":
        return T.Q3_K
    if m.name == "q3_k_m":
        return T.Q5_K if layer < n_layers // 16 else T.Q4_K
    if m.name in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
        return T.Q6_K
    if m.name in ("q4_k_s", "iq4_nl", "iq4_xs") and layer < n_layers // 8:
        return T.Q5_K
    return m.default
