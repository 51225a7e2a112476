"""GGUF files -> ModelConfig + tensors, memory-mapped through the gguf package's reader.

No tensor is copied at load: each GGUFTensor holds a numpy view into the file's memmap, and
`GGUFTensor.torch()` wraps that view without a copy. Layers decide later whether to keep the GGUF
blocks (and dequantize as they go) or to dequantize once.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from hetero.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the reason in words."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, numpy order: (rows, cols) = reversed GGUF ne
    data: np.ndarray  # memmap view: typed for F32/F16, uint8 blocks (rows, row_bytes) otherwise

    def torch(self) -> torch.Tensor:
        """The file's bytes as a torch tensor, without a copy (read-only: never write to it)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read
            return torch.from_numpy(self.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    The reader slices its buffer once per metadata element (100k times for a 50k vocabulary);
    np.memmap's Python-level __getitem__/__array_finalize__ make that 2-3x slower than slicing a
    plain ndarray view of the same mapping. The view keeps the memmap (and the mapping) alive.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


class GGUFModel:
    """An opened GGUF file: metadata, config and tensors by name."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.metadata = _read_metadata(self.reader)
        self.tensors = {t.name: _wrap(t) for t in self.reader.tensors}
        _check_extents(self.path, self.reader)
        self.config = config_from_metadata(self.metadata, self.tensors)
        _check_types(self.tensors)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return self.tensors[name]

    def get(self, name: str) -> GGUFTensor | None:
        return self.tensors.get(name)

    @property
    def file_size(self) -> int:
        return self.path.stat().st_size


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    return GGUFModel(path)


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise GGUFError(f"model file not found: {path}")
    if path.is_dir():
        raise GGUFError(f"{path} is a directory; give the path of a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise GGUFError(f"{path} is truncated or corrupt: {e}") from e


def _check_extents(path: Path, reader: GGUFReader) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"{path} is truncated: tensor {t.name} ends at byte {end} "
                f"but the file has {size} bytes"
            )


def _wrap(t) -> GGUFTensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return GGUFTensor(t.name, GGMLQuantizationType(int(t.tensor_type)), shape, t.data)


def _field_value(field) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return field  # arrays (vocabularies) stay lazy; the tokenizer reads them
    return field.contents()


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items()}


def _check_types(tensors: dict[str, GGUFTensor]) -> None:
    from hetero.quant import UnsupportedTensorType, get_quant

    for t in tensors.values():
        try:
            get_quant(t.ggml_type)
        except UnsupportedTensorType as e:
            raise GGUFError(f"tensor {t.name}: {e}") from e


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"metadata key {key!r} is missing")
    return meta[key]


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, GGUFTensor]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GGUFError(f"architecture {arch!r} is not supported; supported: {known}")
    n_heads = int(_require(meta, f"{arch}.attention.head_count"))
    d_model = int(_require(meta, f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // n_heads))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError("tensor 'token_embd.weight' is missing")
    cfg = ModelConfig(
        arch=arch,
        name=str(meta.get("general.name", "")),
        n_layers=int(_require(meta, f"{arch}.block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(meta.get(f"{arch}.feed_forward_length", 0)),
        vocab_size=int(meta.get(f"{arch}.vocab_size", embd.shape[0])),
        context_length=int(meta.get(f"{arch}.context_length", 4096)),
        norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_style="normal" if arch == "llama" else "neox",
        rope_scaling=_rope_scaling(meta, arch, truncate=arch != "gpt-oss"),
        tied_embeddings="output.weight" not in tensors,
        attn_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **_moe_fields(meta, arch),
        **_window_fields(meta, arch, int(_require(meta, f"{arch}.block_count"))),
    )
    if cfg.d_ff == 0 and not cfg.is_moe:
        raise GGUFError(f"metadata key '{arch}.feed_forward_length' is missing")
    return check_experts(cfg, tensors) if cfg.is_moe else cfg


def _rope_scaling(meta: dict[str, Any], arch: str, truncate: bool = True) -> RopeScaling:
    p = f"{arch}.rope.scaling."
    kind = str(meta.get(p + "type", "none"))
    factor = float(meta.get(p + "factor", 1.0))
    if kind in ("none", "") or factor in (0.0, 1.0):
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"rope scaling type {kind!r} is not supported; supported: linear, yarn")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_context_length=int(meta.get(p + "original_context_length", 0)),
        beta_fast=float(meta.get(p + "yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(p + "yarn_beta_slow", 1.0)),
        attn_factor=float(meta.get(p + "attn_factor", 0.0)),
        truncate=truncate,
    )


def _per_layer(value: Any, key: str) -> Any:
    """A key llama.cpp reads as one value or an array of one value per layer: the value (the
    array's when all its entries agree; experts of different widths per layer are refused)."""
    if not hasattr(value, "contents"):
        return value
    values = value.contents()
    if not values or any(v != values[0] for v in values):
        raise GGUFError(f"metadata key {key!r}: per-layer values {values} are not supported")
    return values[0]


def _moe_fields(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The expert counts and width of a mixture-of-experts file (none for a dense one)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    n = int(_require(meta, f"{arch}.expert_count"))
    used = int(_require(meta, f"{arch}.expert_used_count"))
    if not 1 <= used <= n:
        raise GGUFError(f"{arch}.expert_used_count is {used}; it must be in 1..{n} (expert_count)")
    key = f"{arch}.expert_feed_forward_length"
    return dict(
        n_experts=n,
        n_experts_used=used,
        d_ff_expert=int(_per_layer(meta.get(key, 0), key)),
        # llama.cpp renormalizes qwen3moe's chosen weights whatever the file says
        expert_weights_norm=arch == "qwen3moe"
        or bool(meta.get(f"{arch}.expert_weights_norm", False)),
    )


def _window_fields(meta: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """Sliding-window attention: the window, and which layers have it. llama.cpp's rule for a
    file without `sliding_window_pattern` (gpt-oss): every other layer from the first
    (pattern 2: layer i slides when i % 2 < 1); an integer pattern n: i % n < n - 1; an array:
    one flag a layer."""
    window = int(meta.get(f"{arch}.attention.sliding_window", 0))
    if window <= 0:
        return {}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2)
    if hasattr(pattern, "contents"):
        flags = tuple(bool(v) for v in pattern.contents())
        if len(flags) != n_layers:
            raise GGUFError(
                f"{arch}.attention.sliding_window_pattern has {len(flags)} entries for "
                f"{n_layers} layers"
            )
    else:
        n = int(pattern)
        flags = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
    return dict(sliding_window=window, swa_layers=flags)


def check_experts(cfg: ModelConfig, tensors: dict[str, GGUFTensor]) -> ModelConfig:
    """The expert tensors of every layer against the metadata's counts: a router of
    expert_count rows, 3-D [expert_count, F, C] gate/up and [expert_count, C, F] down tensors.
    Returns cfg with the expert width F (from the tensors where the metadata has no
    expert_feed_forward_length)."""
    n, c = cfg.n_experts, cfg.d_model
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    if not cfg.d_ff_expert and gate is not None and len(gate.shape) == 3:
        cfg = dataclasses.replace(cfg, d_ff_expert=gate.shape[1])
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        router = tensors.get(p + "ffn_gate_inp.weight")
        if router is None:
            raise GGUFError(f"tensor '{p}ffn_gate_inp.weight' (the expert router) is missing")
        if router.shape != (n, c):
            raise GGUFError(
                f"{p}ffn_gate_inp.weight is {list(router.shape)}: the metadata says "
                f"{cfg.arch}.expert_count = {n} experts of width {c}"
            )
        for part in ("gate", "up", "down"):
            name = f"{p}ffn_{part}_exps.weight"
            t = tensors.get(name)
            if t is None:
                raise GGUFError(f"tensor {name!r} is missing")
            f = cfg.d_ff_expert
            want = (n, c, f) if part == "down" else (n, f, c)
            if t.shape != want:
                raise GGUFError(
                    f"{name} is {list(t.shape)}, expected {list(want)} from the metadata "
                    f"({cfg.arch}.expert_count = {n}, expert_feed_forward_length = {f})"
                )
    return cfg
