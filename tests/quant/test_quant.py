"""hetero.quant dequantizers equal gguf.quants.dequantize bit for bit, for every registered type.

The tests walk the registry, so a newly registered type is tested by being registered.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from hetero.quant import (
    QuantType,
    UnsupportedTensorType,
    dequantize,
    get_quant,
    iq_grids,
    random_blocks,
    row_bytes,
    supported_types,
    to_torch,
)

TYPES = supported_types()
IDS = [q.name for q in TYPES]
# (rows, blocks per row): one block, one row, several rows, a wider matrix
LAYOUTS = [(1, 1), (1, 7), (5, 3), (16, 12)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _masked_random_bytes(qt: QuantType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Fully random blocks, with exponent-all-ones (inf/nan) fp16 fields made finite.

    Clearing the top exponent bit keeps sign, subnormals, zeros and mantissa bits random.
    """
    raw = rng.integers(0, 256, size=(n_blocks, qt.type_size), dtype=np.uint8)
    for off in qt.f16_offsets:
        hi = raw[:, off + 1]
        hi[(hi & 0x7C) == 0x7C] &= 0xBF
    if qt.name == "IQ1_M":  # d's exponent: bits 6-7 of byte 53 and 4-6 of byte 55 (iquants)
        raw[((raw[:, 53] & 0xC0) == 0xC0) & ((raw[:, 55] & 0x70) == 0x70), 55] &= 0xBF
    return raw


def _check_equal_to_gguf(qt: QuantType, blocks: np.ndarray, rows: int) -> None:
    data = blocks.reshape(rows, -1)
    cols = data.shape[1] // qt.type_size * qt.block_size
    with np.errstate(over="ignore"):  # MXFP4's largest scale times its largest codes: inf
        expected = quants.dequantize(data, qt.ggml_type)
    got = dequantize(torch.from_numpy(data), qt.ggml_type, (rows, cols))
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    assert expected.shape == (rows, cols)
    assert np.array_equal(_bits(got.numpy()), _bits(expected)), qt.name


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay[0]}x{lay[1]}")
def test_random_blocks_dequantize_like_gguf(qt: QuantType, layout: tuple[int, int]) -> None:
    rows, per_row = layout
    rng = np.random.default_rng(rows * 100 + per_row)
    _check_equal_to_gguf(qt, random_blocks(qt.ggml_type, rows * per_row, rng), rows)


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay[0]}x{lay[1]}")
def test_any_finite_bytes_dequantize_like_gguf(qt: QuantType, layout: tuple[int, int]) -> None:
    rows, per_row = layout
    rng = np.random.default_rng(7 + rows * 100 + per_row)
    _check_equal_to_gguf(qt, _masked_random_bytes(qt, rows * per_row, rng), rows)


@pytest.mark.parametrize("qt", [q for q in TYPES if q.block_size > 1], ids=lambda q: q.name)
def test_many_blocks_cross_cpu_work_items(qt: QuantType) -> None:
    """Large tensors are dequantized in pieces on CPU: the seams must not show."""
    rng = np.random.default_rng(3)
    n_blocks = (1 << 21) // qt.block_size + 3  # two full work items and a ragged tail
    _check_equal_to_gguf(qt, _masked_random_bytes(qt, n_blocks, rng), 1)


@pytest.mark.parametrize("name", ["F16", "F32"])
def test_typed_float_tensors_as_gguf_reader_gives_them(name: str) -> None:
    qt = get_quant(name)
    rng = np.random.default_rng(0)
    raw = _masked_random_bytes(qt, 6 * 64, rng)  # F32: any bits, NaN payloads included
    typed = torch.from_numpy(raw.view(np.float16 if name == "F16" else np.float32).reshape(6, 64))
    got = dequantize(typed, name, (6, 64))
    expected = quants.dequantize(typed.numpy(), qt.ggml_type)
    assert np.array_equal(_bits(got.numpy()), _bits(expected))
    assert got.data_ptr() != typed.data_ptr()  # never an alias of a read-only file mapping


def test_leading_dims_and_1d_shapes() -> None:
    rng = np.random.default_rng(1)
    blocks = random_blocks("Q4_K", 2 * 3 * 2, rng)
    data = torch.from_numpy(blocks.reshape(2, 3, 2 * 144))
    flat = dequantize(data.reshape(6, -1), "q4_k", (6, 512))
    assert torch.equal(
        dequantize(data, GGMLQuantizationType.Q4_K, (2, 3, 512)).reshape(6, 512), flat
    )
    one_d = dequantize(data.reshape(-1), 12, (6 * 512,))
    assert torch.equal(one_d, flat.reshape(-1))


def test_dequantize_rejects_bad_input() -> None:
    data = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(data, "Q4_0", (4, 64))
    with pytest.raises(ValueError, match="32-blocks"):
        dequantize(data, "Q4_0", (4, 33))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(data.to(torch.int32), "Q4_0", (4, 32))
    with pytest.raises(ValueError, match="elements"):
        dequantize(torch.zeros(10, dtype=torch.float16), "F16", (3, 4))


@pytest.mark.parametrize("name", ["TQ1_0", "TQ2_0", "NVFP4", "Q8_1", "Q8_K", "I8", "F64"])
def test_unsupported_types_are_refused_by_name(name: str) -> None:
    t = GGMLQuantizationType[name]
    for key in (t, int(t), name, name.lower()):
        with pytest.raises(UnsupportedTensorType, match=f"{name} is not supported yet") as info:
            get_quant(key)
        assert isinstance(info.value, ValueError)
        assert "Q4_K" in str(info.value)  # lists what is supported
    with pytest.raises(UnsupportedTensorType, match=name):
        dequantize(torch.zeros(4, dtype=torch.uint8), t, (1, 32))
    with pytest.raises(UnsupportedTensorType, match=name):
        row_bytes(t, 256)


def test_mxfp4_every_exponent_like_gguf() -> None:
    """All 256 scale bytes, the subnormal scales (e < 2) and the overflow to inf (e = 255 with
    the largest codes) included, with every code in each block."""
    codes = np.arange(16, dtype=np.uint8)
    qs = codes | (codes[::-1] << 4)  # elements 0..15: codes 0..15; 16..31: codes 15..0
    blocks = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(qs, (256, 1))], 1)
    _check_equal_to_gguf(get_quant("MXFP4"), blocks, 256)
    w = dequantize(torch.from_numpy(blocks), "MXFP4", (256, 32))
    assert w[2, 1].item() == 2.0**-126 and w[0, 1].item() == 2.0**-128  # code 1: 0.5, doubled
    assert w[130, 7].item() == 12 * 2.0**2  # code 7: 6, doubled, times 2^(130 - 128)
    assert torch.isinf(w[255]).sum() == 24  # 2^127 times a doubled value >= 2: past 2^128


@pytest.mark.parametrize("name", sorted(iq_grids.GRIDS))
def test_iq_grids_equal_gguf(name: str) -> None:
    """The copied, packed grids decode to gguf's own tables (llama.cpp's iq*_grid values)."""
    cls = getattr(quants, name)
    cls.init_grid()
    ours = iq_grids.grid(name, torch.device("cpu")).numpy()
    assert ours.shape == cls.grid_shape
    assert np.array_equal(ours, cls.grid.reshape(cls.grid_shape))
    signs = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    assert np.array_equal(iq_grids.ksigns_table(), signs)


def test_unknown_types_are_refused() -> None:
    for key in (999, "Q9_9", "not a type"):
        with pytest.raises(UnsupportedTensorType, match="unknown GGUF tensor type"):
            get_quant(key)


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_registry_geometry_matches_gguf(qt: QuantType) -> None:
    assert (qt.block_size, qt.type_size) == GGML_QUANT_SIZES[qt.ggml_type]
    assert qt.name == qt.ggml_type.name
    assert get_quant(qt.name.lower()) is qt is get_quant(int(qt.ggml_type))
    cols = qt.block_size * 24
    assert row_bytes(qt.ggml_type, cols) == 24 * qt.type_size
    if qt.block_size > 1:
        with pytest.raises(ValueError, match="multiple"):
            row_bytes(qt.name, cols + 1)


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_random_blocks_are_finite_and_weight_like(qt: QuantType) -> None:
    n = 8192 // qt.block_size + 16
    blocks = random_blocks(qt.ggml_type, n, np.random.default_rng(42))
    assert blocks.dtype == np.uint8 and blocks.shape == (n, qt.type_size)
    again = random_blocks(qt.ggml_type, n, np.random.default_rng(42))
    assert np.array_equal(blocks, again)  # reproducible from the generator
    values = quants.dequantize(blocks.reshape(1, -1), qt.ggml_type)
    assert np.isfinite(values).all()
    assert 0.005 < float(values.std()) < 0.08, float(values.std())
    assert abs(float(values.mean())) < 0.01
    assert len(np.unique(blocks[:, -1])) > 1  # not a constant pattern


def test_random_blocks_bulk_speed() -> None:
    """The 8B synthetic model writes ~5 GB through this: it must run at memory speed."""
    rng = np.random.default_rng(0)
    random_blocks("Q4_K", 1024, rng)
    start = time.perf_counter()
    blocks = random_blocks("Q4_K", 400_000, rng)  # 57.6 MB
    elapsed = time.perf_counter() - start
    assert blocks.nbytes == 400_000 * 144
    assert elapsed < 3.0, f"{elapsed:.2f} s for 58 MB"


def test_to_torch_views_read_only_memmaps_without_warning(tmp_path) -> None:
    path = tmp_path / "w.bin"
    np.arange(64, dtype=np.uint8).tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = to_torch(mm)
    assert t.data_ptr() == mm.ctypes.data  # a view, not a copy
    assert t.tolist() == list(range(64))


def test_real_model_tensors_equal_gguf(smollm2_path) -> None:
    reader = GGUFReader(smollm2_path)
    by_type: dict[str, object] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, t)
    assert {"Q4_1", "Q8_0", "F32"} <= set(by_type)
    for name, t in by_type.items():
        data = t.data if name != "Q8_0" else t.data[:2048]  # the embedding: 2048 of its rows
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        shape = (data.shape[0], *shape[1:]) if name == "Q8_0" else shape
        got = dequantize(to_torch(data), t.tensor_type, shape)
        expected = quants.dequantize(np.asarray(data), t.tensor_type)
        assert np.array_equal(_bits(got.numpy()), _bits(expected.reshape(shape))), t.name


@pytest.mark.gpu
@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_cuda_dequantize_equals_cpu(qt: QuantType) -> None:
    """The same torch code on a GPU gives the same bits (no numpy, no host-only ops inside)."""
    blocks = _masked_random_bytes(qt, 4096, np.random.default_rng(9)).reshape(16, -1)
    cols = blocks.shape[1] // qt.type_size * qt.block_size
    cpu = dequantize(torch.from_numpy(blocks), qt.ggml_type, (16, cols))
    gpu = dequantize(torch.from_numpy(blocks).cuda(), qt.ggml_type, (16, cols))
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))
