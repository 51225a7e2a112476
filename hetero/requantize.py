"""`hetero quantize`: re-quantize a GGUF file to another mix, as `llama-quantize` would.

Every 2D weight is dequantized with `hetero.quant.dequantize` and quantized with
`hetero.quant.quantize` to the type `tensor_type_for` gives (the same llama.cpp rules as
`hetero synth`, fallbacks included: SmolLM2's 576-wide rows cannot hold K-quants, so most of its
tensors fall back while ffn_down, 1536 wide, takes the K-quant). A tensor whose type does not
change is copied byte for byte; 1D tensors (norms, biases) stay F32. All metadata is copied, with
`general.file_type` updated. Tensor data streams in row chunks (bounded memory).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor
from tqdm import tqdm

from hetero.quant import dequantize, get_quant, quantize, row_bytes, supported_types
from hetero.quant_mix import QuantMix, get_mix, is_quantizable, tensor_type_for

T = GGMLQuantizationType
CHUNK_ELEMS = 1 << 20  # 4 MB of float32 per conversion step: stays in cache
# Keys the writer sets itself, or that describe the source file rather than the model.
_SKIPPED_KEYS = (
    "general.architecture",
    "general.file_type",
    "general.quantization_version",
    "split.no",
    "split.count",
    "split.tensors.count",
)


@dataclass(frozen=True)
class _Job:
    tensor: ReaderTensor
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    target: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * row_bytes(self.target, self.shape[-1])


def requantize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    qtype: str,
    progress: bool = True,
) -> dict[str, int]:
    """Re-quantize `src` into `dst` with mix `qtype`; returns {output type name: tensor count}."""
    src, dst = Path(src), Path(dst)
    mix = get_mix(qtype)
    if not src.is_file():
        raise FileNotFoundError(f"input model {src} does not exist")
    if dst.resolve() == src.resolve() or (dst.exists() and dst.samefile(src)):
        raise ValueError(f"output {dst} is the input file; choose another output path")
    try:
        reader = GGUFReader(src)
    except (ValueError, OSError) as err:
        raise ValueError(f"{src} is not a readable GGUF file: {err}") from err
    arch = _field(reader, "general.architecture")
    jobs = _plan(reader, mix, arch)
    _check_writable(jobs)

    partial = dst.with_name(dst.name + ".partial")
    writer = GGUFWriter(partial, arch)
    _copy_metadata(reader, writer, mix)
    for job in jobs:
        writer.add_tensor_info(
            job.tensor.name, job.shape, np.dtype(np.float32), job.nbytes, job.target
        )
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        _stream(writer.fout[0], jobs, writer.data_alignment, progress)
        writer.close()
        os.replace(partial, dst)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return dict(Counter(job.target.name for job in jobs))


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file has no {key!r} metadata")
        return default
    return field.contents()


def _plan(reader: GGUFReader, mix: QuantMix, arch: str) -> list[_Job]:
    """The output type of every tensor, by llama.cpp's rules."""
    n_layers = int(_field(reader, f"{arch}.block_count"))
    n_heads = _field(reader, f"{arch}.attention.head_count", 1)
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_heads)
    # Per-layer head counts arrive as arrays in some files: the first layer decides n_gqa.
    n_heads, n_kv = (v[0] if isinstance(v, list) else v for v in (n_heads, n_kv))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    jobs = []
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if is_quantizable(t.name, len(shape)):
            target = tensor_type_for(
                t.name, shape[-1], mix.name, None, n_layers,
                n_dims=len(shape), tied_embeddings=tied, n_gqa=max(1, n_heads // max(1, n_kv)),
            )  # fmt: skip
        elif t.tensor_type in (T.F32, T.F16, T.BF16):
            target = T.F32
        else:
            target = t.tensor_type  # a quantized tensor llama.cpp would not touch: copy it
        jobs.append(_Job(t, shape, target))
    return jobs


def _check_writable(jobs: list[_Job]) -> None:
    """Refuse, before anything is written, a target type with no quantizer (the grid IQ types)."""
    missing = {
        job.target.name
        for job in jobs
        if job.target != job.tensor.tensor_type and get_quant(job.target).quantize is None
    }
    if missing:
        writable = ", ".join(q.name for q in supported_types() if q.quantize is not None)
        raise ValueError(
            f"hetero cannot quantize to {', '.join(sorted(missing))}; it writes {writable}"
        )


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, mix: QuantMix) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _SKIPPED_KEYS:
            continue
        if key == "general.alignment":
            writer.add_custom_alignment(int(field.contents()))
            continue
        main = field.types[0]
        if main == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ValueError(f"{key}: nested metadata arrays are not supported")
            writer.add_key_value(key, field.contents(), main, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), main)
    writer.add_file_type(int(mix.file_type))
    writer.add_quantization_version(2)


def _stream(fout: BinaryIO, jobs: list[_Job], align: int, progress: bool) -> None:
    _pad(fout, align)
    total = sum(job.nbytes for job in jobs)
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="quantize") as bar:
        for job in jobs:
            try:
                for chunk in _convert(job):
                    chunk.tofile(fout)
                    bar.update(chunk.nbytes)
            except ValueError as err:  # unsupported source type, non-finite weights ...
                raise ValueError(
                    f"{job.tensor.name} ({job.tensor.tensor_type.name}): {err}"
                ) from err
            _pad(fout, align)


def _convert(job: _Job) -> Iterator[np.ndarray]:
    """The target-type bytes of one tensor, a row chunk at a time."""
    data, source = job.tensor.data, job.tensor.tensor_type
    if job.target == source:
        flat = data.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, 4 * CHUNK_ELEMS):
            yield flat[start : start + 4 * CHUNK_ELEMS]
        return
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    n_cols = job.shape[-1]
    n_rows = math.prod(job.shape[:-1])
    step = max(1, CHUNK_ELEMS // n_cols)
    for start in range(0, n_rows, step):
        # A copy of the mapped rows: torch warns on read-only file mappings (and must not write).
        piece = torch.from_numpy(np.array(rows[start : start + step]))
        x = dequantize(piece, source, (piece.shape[0], n_cols)).numpy()
        yield quantize(x, job.target)


def _pad(fout: BinaryIO, align: int) -> None:
    fout.write(b"\0" * (-fout.tell() % align))
