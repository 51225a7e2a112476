"""GGUF loading: config from metadata, tensors mapped without a copy, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from hetero.gguf_loader import GGUFError, load_gguf


def _write(path, arch="llama", tensors=None, meta=True):
    w = GGUFWriter(str(path), arch)
    if meta:
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(32)
        w.add_feed_forward_length(64)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-5)
    for name, (arr, raw_type) in (
        tensors or {"token_embd.weight": (np.ones((10, 32), np.float32), None)}
    ).items():
        w.add_tensor(name, arr, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_smollm2_config(smollm2_path):
    gm = load_gguf(smollm2_path)
    c = gm.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.d_ff, c.vocab_size, c.context_length) == (64, 1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.rope_style == "normal" and c.tied_embeddings
    assert not c.attn_bias and not c.qk_norm
    t = gm.tensor("blk.0.ffn_down.weight")
    assert t.ggml_type == GGMLQuantizationType.Q4_1 and t.shape == (576, 1536)
    assert t.data.shape == (576, 1536 // 32 * 20)  # 20-byte Q4_1 blocks of 32 values


def test_tensors_are_mapped_not_copied(smollm2_path):
    gm = load_gguf(smollm2_path)
    t = gm.tensor("token_embd.weight")
    assert np.shares_memory(t.data, gm.reader.data)
    base = gm.reader.data.ctypes.data
    ptr = t.torch().data_ptr()
    assert base <= ptr < base + gm.reader.data.nbytes


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path):
    with pytest.raises(GGUFError, match="directory"):
        load_gguf(tmp_path)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(p)


def test_truncated(tmp_path):
    p = _write(tmp_path / "t.gguf")
    data = p.read_bytes()
    for cut in (len(data) - 100, 40, 8):
        q = tmp_path / f"cut{cut}.gguf"
        q.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated or corrupt|truncated"):
            load_gguf(q)


def test_unsupported_architecture(tmp_path):
    p = _write(tmp_path / "a.gguf", arch="mamba")
    with pytest.raises(GGUFError, match=r"architecture 'mamba' is not supported.*llama.*qwen2"):
        load_gguf(p)


def test_missing_metadata(tmp_path):
    p = _write(tmp_path / "m.gguf", meta=False)
    with pytest.raises(GGUFError, match="missing"):
        load_gguf(p)


def test_unsupported_tensor_type(tmp_path):
    # TQ2_0: 256 ternary values in 66 bytes; valid layout, not a type hetero computes yet.
    raw = np.zeros((10, 66), np.uint8)
    p = _write(
        tmp_path / "tq.gguf", tensors={"token_embd.weight": (raw, GGMLQuantizationType.TQ2_0)}
    )
    with pytest.raises(GGUFError, match=r"token_embd.weight.*TQ2_0.*not supported.*MXFP4"):
        load_gguf(p)
