"""`hetero synth`: full-size llama-family GGUF files with random weights and a real tokenizer.

Benchmarks need the bytes and shapes of a real model (an 8B Q4_K_M file is ~4.9 GB), not its
knowledge. We write the metadata llama.cpp reads, tensors named and shaped as llama.cpp names
them (GGUF dim order: ne0 = input features, so a numpy (rows, cols) matrix is (out, in)), and
weights drawn from `hetero.quant.random_blocks`: finite blocks whose dequantized values look
like trained weights (~N(0, 0.02)). Norms are near 1.0 and biases small (F32).

Speed: generating every block of 4.9 GB would dominate, so each file draws a pool of random
blocks per type once and every tensor gathers its blocks from the pool at random indices
(`np.take`, GB/s). Tensor data streams to disk chunk by chunk, so memory stays at a few pools
plus one chunk whatever the model size.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from tqdm import tqdm

from hetero.quant import get_quant, random_blocks, row_bytes
from hetero.quant_mix import QUANT_MIXES, QuantMix, get_mix, tensor_type_for
from hetero.synth_chat import get_family
from hetero.synth_shapes import SHAPES, ModelShape, get_shape, llama3_rope_factors
from hetero.synth_vocab import add_vocab_metadata, build_vocab

__all__ = [
    "QUANT_MIXES",
    "SHAPES",
    "ModelShape",
    "TensorSpec",
    "tensor_specs",
    "tensor_type_for",
    "write_synthetic",
]

T = GGMLQuantizationType
POOL_UNITS = 1 << 15  # random blocks drawn per type (a few MB)
CHUNK_BYTES = 32 << 20  # tensor data written per step
NORM_STD, BIAS_STD = 0.05, 0.02  # RMSNorm gains ~ N(1, 0.05), biases ~ N(0, 0.02)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: numpy-order shape ((rows, cols) = (out, in), or (n,))."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        return self.n_rows * row_bytes(self.qtype, self.n_cols)


def _layer_shapes(s: ModelShape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    d, f, h = s.d_model, s.d_ff, s.head_dim
    q, kv = s.n_heads * h, s.n_kv_heads * h
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (d,),
        "attn_q.weight": (q, d),
        "attn_k.weight": (kv, d),
        "attn_v.weight": (kv, d),
    }
    if s.attn_bias:
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if s.qk_norm:
        shapes |= {"attn_q_norm.weight": (h,), "attn_k_norm.weight": (h,)}
    shapes["attn_output.weight"] = (d, q)
    if s.arch == "gpt-oss":
        shapes |= {"attn_output.bias": (d,), "attn_sinks.weight": (s.n_heads,)}
    if s.n_experts:
        return [(f"blk.{i}.{key}", dims) for key, dims in (shapes | _expert_shapes(s)).items()]
    shapes |= {
        "ffn_norm.weight": (d,),
        "ffn_gate.weight": (f, d),
        "ffn_up.weight": (f, d),
        "ffn_down.weight": (d, f),
    }
    return [(f"blk.{i}.{key}", dims) for key, dims in shapes.items()]


def _expert_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    """The norm, router and 3-D expert tensors of a mixture-of-experts block, as llama.cpp's
    converter names them (numpy order: GGUF ne reversed)."""
    d, e, f = s.d_model, s.n_experts, s.d_ff_expert
    norm = "post_attention_norm" if s.arch == "gpt-oss" else "ffn_norm"
    shapes: dict[str, tuple[int, ...]] = {
        f"{norm}.weight": (d,),
        "ffn_gate_inp.weight": (e, d),
        "ffn_gate_exps.weight": (e, f, d),
        "ffn_up_exps.weight": (e, f, d),
        "ffn_down_exps.weight": (e, d, f),
    }
    if s.arch == "gpt-oss":  # biases on the router and on every expert matrix
        shapes |= {
            "ffn_gate_inp.bias": (e,),
            "ffn_gate_exps.bias": (e, f),
            "ffn_up_exps.bias": (e, f),
            "ffn_down_exps.bias": (e, d),
        }
    return shapes


def tensor_specs(shape: str | ModelShape, quant: str) -> list[TensorSpec]:
    """Every tensor of a `shape` model in the `quant` mix, in file order."""
    s, mix = get_shape(shape), get_mix(quant)
    named: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab_size, s.d_model))]
    if (s.rope_scaling or {}).get("type") == "llama3":
        named.append(("rope_freqs.weight", (s.head_dim // 2,)))
    for i in range(s.n_layers):
        named += _layer_shapes(s, i)
    named.append(("output_norm.weight", (s.d_model,)))
    if not s.tied_embeddings:
        named.append(("output.weight", (s.vocab_size, s.d_model)))
    return [TensorSpec(name, dims, _type_of(name, dims, s, mix)) for name, dims in named]


def _type_of(name: str, dims: tuple[int, ...], s: ModelShape, mix: QuantMix) -> T:
    return tensor_type_for(
        name, dims[-1], mix.name, None, s.n_layers,
        n_dims=len(dims), tied_embeddings=s.tied_embeddings, n_gqa=s.n_gqa,
    )  # fmt: skip


def add_model_metadata(w: GGUFWriter, s: ModelShape, mix: QuantMix, name: str) -> None:
    """The `general.*` and `{arch}.*` keys of a `s` model, as llama.cpp's converter writes them."""
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    if s.head_dim * s.n_heads != s.d_model:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.n_experts:
        w.add_expert_count(s.n_experts)
        w.add_expert_used_count(s.n_experts_used)
        w.add_expert_feed_forward_length(s.d_ff_expert)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(s.norm_eps)
    w.add_vocab_size(s.vocab_size)
    scaling = s.rope_scaling or {}
    if scaling.get("type") in ("linear", "yarn"):
        # llama3 scaling has no keys: llama.cpp reads it from the rope_freqs.weight tensor.
        w.add_rope_scaling_type(RopeScalingType(scaling["type"]))
        w.add_rope_scaling_factor(float(scaling["factor"]))
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    w.add_file_type(int(mix.file_type))
    w.add_quantization_version(2)  # GGML_QNT_VERSION


class _RandomWeights:
    """Random tensor data for one file, deterministic in the seed and the tensor order."""

    def __init__(self, shape: ModelShape, specs: list[TensorSpec], seed: int) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        # Pool rows per (type, unit): no more than the file's largest tensor of that kind uses.
        self.pool_rows: dict[tuple[T, int], int] = {}
        for spec in specs:
            if len(spec.shape) > 1:
                key, units = self._units(spec)
                self.pool_rows[key] = min(POOL_UNITS, max(self.pool_rows.get(key, 0), units))
        self.pools: dict[tuple[T, int], np.ndarray] = {}
        self.buffer = np.empty(0, np.uint8)

    @staticmethod
    def _units(spec: TensorSpec) -> tuple[tuple[T, int], int]:
        """((type, blocks per gathered unit), units in the tensor)."""
        qt = get_quant(spec.qtype)
        n_blocks, type_size = spec.n_cols // qt.block_size, qt.type_size
        # Gather runs of >= ~128 bytes so each copy is worth its index (F16 blocks are 2 bytes).
        unit = math.gcd(n_blocks, 1 << max(0, math.ceil(math.log2(128 / type_size))))
        return (spec.qtype, unit), spec.n_rows * n_blocks // unit

    def _pool(self, key: tuple[T, int]) -> np.ndarray:
        """(pool rows, unit * type_size) uint8: `unit` consecutive random blocks per row."""
        if key not in self.pools:
            qtype, unit = key
            blocks = random_blocks(qtype, self.pool_rows[key] * unit, self.rng)
            self.pools[key] = blocks.reshape(self.pool_rows[key], -1)
        return self.pools[key]

    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        if len(spec.shape) == 1:
            yield self._vector(spec).astype(np.float32)
            return
        key, n_units = self._units(spec)
        pool = self._pool(key)
        units_per_row = n_units // spec.n_rows
        rows_per_chunk = max(1, CHUNK_BYTES // row_bytes(spec.qtype, spec.n_cols))
        for start in range(0, spec.n_rows, rows_per_chunk):
            rows = min(rows_per_chunk, spec.n_rows - start)
            idx = self.rng.integers(0, len(pool), rows * units_per_row)  # intp: fast take
            # One reused buffer: fresh 32 MB arrays page-fault against the page cache that the
            # writes fill, tripling the gather time. The caller writes a chunk before the next.
            out = self._scratch(idx.size * pool.shape[1]).reshape(idx.size, pool.shape[1])
            yield np.take(pool, idx, axis=0, out=out)

    def _scratch(self, nbytes: int) -> np.ndarray:
        if self.buffer.size < nbytes:
            self.buffer = np.empty(nbytes, np.uint8)
        return self.buffer[:nbytes]

    def _vector(self, spec: TensorSpec) -> np.ndarray:
        n = spec.shape[0]
        if spec.name == "rope_freqs.weight":
            return np.asarray(llama3_rope_factors(self.shape))
        if spec.name.endswith(".bias"):
            return self.rng.normal(0.0, BIAS_STD, n)
        return self.rng.normal(1.0, NORM_STD, n)


def write_synthetic(
    path: str | os.PathLike[str],
    shape: str | ModelShape,
    quant: str = "q4_k_m",
    seed: int = 0,
    progress: bool = True,
    chat: str | None = None,
) -> Path:
    """Write a synthetic `shape` model in the `quant` mix to `path`; returns the path. `chat`
    names a chat family (synth_chat.py) whose template and special tokens the file gets.

    The same (shape, quant, seed) gives the same bytes. The file appears under its name only
    once complete (written as `<name>.partial`, then renamed).
    """
    s, mix = get_shape(shape), get_mix(quant)
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist")
    name = shape if isinstance(shape, str) else f"{s.arch}-{s.n_layers}x{s.d_model}"
    specs = tensor_specs(s, mix.name)
    need, free = sum(spec.nbytes for spec in specs), shutil.disk_usage(path.parent).free
    if need > free:
        raise OSError(
            f"{name} {mix.name} needs {need / 1e9:.2f} GB; {path.parent} has {free / 1e9:.2f}"
        )
    family = get_family(chat) if chat else None
    vocab = build_vocab(s.vocab_size, s.tokenizer_pre, seed, family)

    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, s.arch)
    add_model_metadata(writer, s, mix, f"synthetic {name} {mix.name}")
    add_vocab_metadata(writer, vocab)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, spec.qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        _stream(
            writer.fout[0], specs, _RandomWeights(s, specs, seed), writer.data_alignment, progress
        )
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def _stream(
    fout: BinaryIO, specs: list[TensorSpec], weights: _RandomWeights, align: int, progress: bool
) -> None:
    """Tensor data after the header: each tensor starts at a multiple of `align`."""
    _pad(fout, align)
    total = sum(spec.nbytes for spec in specs)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="synth") as bar:
        for spec in specs:
            written = 0
            for chunk in weights.chunks(spec):
                chunk.tofile(fout)
                written += chunk.nbytes
                bar.update(chunk.nbytes)
            if written != spec.nbytes:
                raise RuntimeError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
            _pad(fout, align)


def _pad(fout: BinaryIO, align: int) -> None:
    fout.write(b"\0" * (-fout.tell() % align))
