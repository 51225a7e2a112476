"""`hetero quantize` on the real SmolLM2-135M Q4_1 file, checked with the real `gguf` package.

SmolLM2's rows are 576 wide (not a multiple of 256), so a K-quant mix holds K-quants only in
ffn_down (1536 columns); every other weight falls back per tensor as llama.cpp's quantizer does.
Error bounds: relative RMS error of each re-quantized weight against the source's dequantized
values, measured on this file (worst tensor: Q8_0 0.0065, Q6_K 0.0184) with some margin.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, quants

from hetero.quant_mix import QUANT_MIXES
from hetero.requantize import requantize
from hetero.synth import write_synthetic

T = GGMLQuantizationType
MAX_REL_RMS = {T.Q8_0: 0.01, T.Q6_K: 0.025}


@pytest.fixture(scope="module")
def outputs(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """mix -> (reader of the output, counts requantize returned); GGUFReader parses SmolLM2's
    49k-token vocabulary in seconds, so each file is read once."""
    folder = tmp_path_factory.mktemp("requant")
    result = {}
    for mix in ("q8_0", "q6_k"):
        dst = folder / f"smollm2-{mix}.gguf"
        counts = requantize(smollm2_path, dst, mix, progress=False)
        result[mix] = (GGUFReader(dst), counts)
    return result


@pytest.fixture(scope="module")
def source(smollm2_path: Path) -> GGUFReader:
    return GGUFReader(smollm2_path)


def _meta(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("mix", ["q8_0", "q6_k"])
def test_tensors_types_and_error(outputs: dict, source: GGUFReader, mix: str) -> None:
    out, counts = outputs[mix]
    src = source
    by_name = {t.name: t for t in out.tensors}
    assert sorted(by_name) == sorted(t.name for t in src.tensors)
    seen: dict[str, int] = {}
    for s in src.tensors:
        o = by_name[s.name]
        assert o.shape.tolist() == s.shape.tolist(), s.name
        seen[o.tensor_type.name] = seen.get(o.tensor_type.name, 0) + 1
        if s.name.endswith("_norm.weight"):
            assert o.tensor_type == T.F32
            np.testing.assert_array_equal(o.data, s.data)
            continue
        n_cols = int(s.shape[0])
        if mix == "q8_0" or n_cols % 256:
            assert o.tensor_type == T.Q8_0, s.name  # Q6_K falls back to Q8_0 on 576-wide rows
        else:
            assert o.tensor_type == T.Q6_K and "ffn_down" in s.name, s.name
        a = quants.dequantize(s.data, s.tensor_type)
        b = quants.dequantize(o.data, o.tensor_type)
        rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
        assert rel < MAX_REL_RMS[o.tensor_type], (s.name, rel)
    assert counts == seen
    if mix == "q6_k":
        assert counts == {"F32": 61, "Q8_0": 181, "Q6_K": 30}


@pytest.mark.parametrize("mix", ["q8_0", "q6_k"])
def test_metadata_copied(outputs: dict, source: GGUFReader, mix: str) -> None:
    src, out = _meta(source), _meta(outputs[mix][0])
    assert out.pop("general.file_type") == int(QUANT_MIXES[mix].file_type)
    assert src.pop("general.file_type") == int(LlamaFileType.MOSTLY_Q4_1)
    assert out == src  # tokens, merges, chat template, hyperparameters ...


def test_q8_0_copies_q8_0_tensors_byte_for_byte(outputs: dict, source: GGUFReader) -> None:
    # token_embd is already Q8_0 in the source: llama.cpp copies such a tensor unchanged.
    src = {t.name: t for t in source.tensors}["token_embd.weight"]
    out = {t.name: t for t in outputs["q8_0"][0].tensors}["token_embd.weight"]
    assert src.tensor_type == out.tensor_type == T.Q8_0
    np.testing.assert_array_equal(out.data, src.data)


def test_q8_0_equals_gguf_pipeline(outputs: dict, source: GGUFReader) -> None:
    # Q4_1 -> float32 -> Q8_0 through the gguf package gives the same bytes.
    src = {t.name: t for t in source.tensors}["blk.3.attn_q.weight"]
    out = {t.name: t for t in outputs["q8_0"][0].tensors}["blk.3.attn_q.weight"]
    expected = quants.quantize(quants.dequantize(src.data, src.tensor_type), T.Q8_0)
    np.testing.assert_array_equal(out.data, expected)


def test_synthetic_k_quant_mix(tmp_path: Path) -> None:
    """A tiny qwen2 (tied embeddings, 640-wide ffn_down) re-quantized Q8_0 -> Q4_K_M gets the
    same per-tensor types as a file `hetero synth` writes directly in Q4_K_M."""
    src, out, counts = _requantize_tiny_qwen2(tmp_path, "q4_k_m")
    types = {t.name: t.tensor_type for t in out.tensors}
    assert types["blk.0.ffn_down.weight"] == T.Q5_0 and types["token_embd.weight"] == T.Q6_K
    assert sum(counts.values()) == len(types) and counts["Q4_K"] > 0
    # Measured worst: Q4_K 0.055, Q5_0 0.031, Q6_K 0.013; Q8_0 and F32 tensors are copied.
    _check_errors(src, out, {T.Q4_K: 0.07, T.Q5_0: 0.04, T.Q6_K: 0.02})


def _requantize_tiny_qwen2(tmp_path: Path, mix: str) -> tuple[Path, GGUFReader, dict]:
    """(source, output, counts) of a tiny qwen2 Q8_0 file re-quantized to `mix`; asserts the
    output holds the types `hetero synth` writes for the mix directly."""
    src = write_synthetic(tmp_path / "src.gguf", "tiny-qwen2", "q8_0", progress=False)
    ref = write_synthetic(tmp_path / "ref.gguf", "tiny-qwen2", mix, progress=False)
    counts = requantize(src, tmp_path / "out.gguf", mix, progress=False)
    out = GGUFReader(tmp_path / "out.gguf")
    types = {t.name: t.tensor_type for t in out.tensors}
    assert types == {t.name: t.tensor_type for t in GGUFReader(ref).tensors}
    return src, out, counts


def _check_errors(src: Path, out: GGUFReader, bounds: dict) -> None:
    """Each output tensor's relative RMS error against the source within its type's bound."""
    source = {t.name: t for t in GGUFReader(src).tensors}
    for t in out.tensors:
        a = quants.dequantize(source[t.name].data, source[t.name].tensor_type)
        b = quants.dequantize(t.data, t.tensor_type)
        rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
        assert rel <= bounds.get(t.tensor_type, 0.0), (t.name, rel)


def test_synthetic_iq4_xs_mix(tmp_path: Path) -> None:
    """Q8_0 -> IQ4_XS on a tiny qwen2: the types `hetero synth` writes for the mix (its 640-wide
    ffn_down falls back to IQ4_NL, the tied embedding takes Q6_K), and IQ4-sized errors."""
    src, out, counts = _requantize_tiny_qwen2(tmp_path, "iq4_xs")
    assert counts == {"Q6_K": 1, "F32": 16, "IQ4_XS": 18, "IQ4_NL": 3}
    # Measured worst: IQ4_XS 0.065, IQ4_NL 0.064, Q6_K 0.013; F32 tensors are copied.
    _check_errors(src, out, {T.IQ4_XS: 0.075, T.IQ4_NL: 0.075, T.Q6_K: 0.02})


def test_errors(smollm2_path: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        requantize(tmp_path / "missing.gguf", tmp_path / "out.gguf", "q8_0", progress=False)
    with pytest.raises(ValueError, match="is the input"):
        requantize(smollm2_path, smollm2_path, "q8_0", progress=False)
    with pytest.raises(ValueError, match="q4_k_m") as err:
        requantize(smollm2_path, tmp_path / "out.gguf", "q4_k_xxl", progress=False)
    assert "unknown quantization type 'q4_k_xxl'" in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind
    with pytest.raises(ValueError, match="cannot quantize to IQ2_XXS; it writes .*IQ4_XS"):
        requantize(smollm2_path, tmp_path / "out.gguf", "pure-iq2_xxs", progress=False)
    assert not list(tmp_path.iterdir())
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        requantize(bogus, tmp_path / "out.gguf", "q8_0", progress=False)
