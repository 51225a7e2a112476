"""`hetero synth`: synthetic GGUF files read back with the real `gguf` reader.

Shapes and quant types are checked against llama.cpp's rules (hand-derived expectations for the
Q4_K_M per-layer choices and the fallbacks), tensor names and shapes against the real SmolLM2
file, llama3 rope factors against transformers, and weights by dequantizing with `gguf.quants`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, quants

from hetero.quant_mix import QUANT_MIXES, tensor_type_for, use_more_bits
from hetero.synth import SHAPES, tensor_specs, write_synthetic
from hetero.synth_shapes import ModelShape, llama3_rope_factors
from hetero.synth_vocab import SPECIAL_TOKENS

T = GGMLQuantizationType
TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
MIXES = ("q8_0", "q4_k_m", "q6_k", "f16")


def meta(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("synth")
    return {
        (shape, mix): write_synthetic(folder / f"{shape}-{mix}.gguf", shape, mix, progress=False)
        for shape in TINY
        for mix in MIXES
    }


# ---- llama.cpp's type rules -------------------------------------------------------------------


def test_use_more_bits_matches_llama_cpp_for_32_layers() -> None:
    # Llama-3-8B Q4_K_M files from llama-quantize hold Q6_K attn_v/ffn_down on exactly these.
    expected = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    assert {i for i in range(32) if use_more_bits(i, 32)} == expected


def test_q4_k_m_rules_and_fallbacks() -> None:
    def ty(name: str, cols: int, mix: str = "q4_k_m", **kw: object) -> T:
        return tensor_type_for(name, cols, mix, None, 32, **kw)  # type: ignore[arg-type]

    assert ty("blk.0.attn_v.weight", 4096) == T.Q6_K
    assert ty("blk.4.attn_v.weight", 4096) == T.Q4_K
    assert ty("blk.6.ffn_down.weight", 14336) == T.Q6_K
    assert ty("blk.7.ffn_down.weight", 14336) == T.Q4_K
    assert ty("blk.7.attn_q.weight", 4096) == T.Q4_K
    assert ty("output.weight", 4096) == T.Q6_K
    assert ty("token_embd.weight", 4096) == T.Q4_K
    assert ty("token_embd.weight", 4096, tied_embeddings=True) == T.Q6_K
    # Rows that do not divide 256 fall back per tensor, as llama.cpp's quantizer does.
    assert ty("blk.7.attn_q.weight", 576) == T.Q5_0
    assert ty("blk.0.attn_v.weight", 576) == T.Q8_0
    assert ty("token_embd.weight", 576, tied_embeddings=True) == T.Q8_0
    assert ty("blk.7.attn_q.weight", 576, "q5_k_s") == T.Q5_1
    assert ty("blk.7.attn_q.weight", 576, "q2_k") == T.Q4_0
    assert ty("blk.7.attn_q.weight", 576, "q3_k_m") == T.Q4_0
    assert ty("blk.7.attn_q.weight", 48, "q4_k_m") == T.F16  # not even 32 divides
    assert ty("blk.7.attn_q.weight", 4096, "q8_0") == T.Q8_0
    assert ty("output.weight", 4096, "q8_0") == T.Q8_0
    assert ty("output.weight", 4096, "q4_0") == T.Q6_K
    assert ty("blk.7.attn_v.weight", 4096, "q2_k", n_gqa=4) == T.Q4_K
    assert ty("blk.7.attn_v.weight", 4096, "q2_k", n_gqa=2) == T.Q3_K
    assert ty("blk.1.attn_v.weight", 4096, "q3_k_m") == T.Q5_K
    assert ty("blk.0.ffn_down.weight", 14336, "q4_k_s") == T.Q5_K
    assert ty("blk.0.attn_norm.weight", 4096, n_dims=1) == T.F32
    assert ty("blk.0.attn_q.weight", 4096, "f16") == T.F16
    assert ty("blk.0.attn_q.weight", 4096, "bf16") == T.BF16


def test_llama3_8b_q4_k_m_matches_llama_quantize() -> None:
    # llama.cpp's loader reports "f32: 65, q4_K: 193, q6_K: 33" for Llama-3-8B Q4_K_M (4.92 GB).
    specs = tensor_specs("llama3-8b", "q4_k_m")
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.qtype.name] = counts.get(spec.qtype.name, 0) + 1
    assert counts == {"F32": 65, "Q4_K": 193, "Q6_K": 33}
    assert sum(spec.nbytes for spec in specs) / 1e9 == pytest.approx(4.91, abs=0.01)


def test_iq4_and_mxfp4_moe_rules_and_fallbacks() -> None:
    def ty(name: str, cols: int, mix: str = "iq4_xs", **kw: object) -> T:
        return tensor_type_for(name, cols, mix, None, 32, **kw)  # type: ignore[arg-type]

    assert ty("blk.7.attn_q.weight", 4096) == T.IQ4_XS
    assert ty("blk.7.attn_q.weight", 576) == T.IQ4_NL  # IQ4_XS falls back to IQ4_NL
    assert ty("blk.7.attn_v.weight", 4096, n_gqa=4) == T.Q5_K
    assert ty("blk.7.attn_v.weight", 4096, n_gqa=2) == T.IQ4_XS
    assert ty("blk.3.ffn_down.weight", 14336) == T.Q5_K  # the first eighth of the layers
    assert ty("blk.4.ffn_down.weight", 14336) == T.IQ4_XS
    assert ty("blk.3.ffn_down.weight", 1408) == T.Q5_1  # Q5_K's fallback
    assert ty("output.weight", 4096) == T.Q6_K
    assert ty("output.weight", 576) == T.Q8_0
    assert ty("token_embd.weight", 4096) == T.IQ4_XS
    assert ty("blk.7.attn_q.weight", 576, "iq4_nl") == T.IQ4_NL
    assert ty("output.weight", 576, "iq4_nl") == T.Q8_0  # Q6_K's fallback
    assert ty("blk.0.ffn_up_exps.weight", 2880, "mxfp4_moe", n_dims=3) == T.MXFP4
    assert ty("blk.0.attn_q.weight", 2880, "mxfp4_moe") == T.Q8_0
    assert ty("token_embd.weight", 2880, "mxfp4_moe") == T.Q8_0
    assert ty("output.weight", 2880, "mxfp4_moe") == T.Q8_0


def test_pure_mixes_give_every_weight_one_type() -> None:
    """llama-quantize --pure: no per-tensor rules, the per-tensor fallback only (tiny-qwen2's
    640-wide ffn_down cannot hold 256-blocks)."""
    for spec in tensor_specs("tiny-qwen2", "pure-iq3_s"):
        if len(spec.shape) == 1:
            assert spec.qtype == T.F32, spec.name
        else:
            expected = T.IQ4_NL if spec.name.endswith("ffn_down.weight") else T.IQ3_S
            assert spec.qtype == expected, spec.name
    assert {s.qtype for s in tensor_specs("tiny-qwen2", "pure-MXFP4") if len(s.shape) == 2} == {
        T.MXFP4
    }
    with pytest.raises(ValueError, match="TQ2_0 is not supported"):
        tensor_specs("tiny-qwen2", "pure-tq2_0")


def test_iq4_xs_types_match_llama_quantize() -> None:
    """llama.cpp's llama_model_quantize (llama-cpp-python 0.3.36) made this IQ4_XS mix of an F16
    file of this shape: n_gqa 4 (attn_v Q5_K), ffn_down 1408 wide (IQ4_XS falls back to IQ4_NL,
    the first two layers' Q5_K to Q5_1)."""
    shape = ModelShape(
        arch="llama", n_layers=16, d_model=512, n_heads=8, n_kv_heads=2, head_dim=64,
        d_ff=1408, vocab_size=4096, context_length=2048, rope_theta=10000.0, norm_eps=1e-5,
        tied_embeddings=False,
    )  # fmt: skip
    counts: dict[str, int] = {}
    for spec in tensor_specs(shape, "iq4_xs"):
        counts[spec.qtype.name] = counts.get(spec.qtype.name, 0) + 1
    assert counts == {"IQ4_XS": 81, "F32": 33, "Q5_K": 16, "Q5_1": 2, "IQ4_NL": 14, "Q6_K": 1}


def test_unknown_mix_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="q4_k_m") as err:
        tensor_type_for("output.weight", 4096, "q4_k_xl", None, 32)
    assert all(name in str(err.value) for name in QUANT_MIXES)
    with pytest.raises(ValueError, match="tiny-llama"):
        write_synthetic("unused.gguf", "llama-9000b", "q8_0", progress=False)


def test_real_shapes_are_consistent() -> None:
    for name, shape in SHAPES.items():
        assert shape.n_heads % shape.n_kv_heads == 0, name
        assert shape.vocab_size >= 256 + len(SPECIAL_TOKENS), name
    # Parameter counts of the published models (to 2%), from their configs.
    for name, billions in (("llama3-8b", 8.03), ("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19)):
        assert SHAPES[name].n_params / 1e9 == pytest.approx(billions, rel=0.02), name
    with pytest.raises(ValueError, match="multiple"):
        ModelShape("llama", 2, 256, 4, 3, 64, 512, 1000, 512, 1e4, 1e-5, True)


# ---- files written and read back -------------------------------------------------------------


@pytest.mark.parametrize("shape", TINY)
@pytest.mark.parametrize("mix", MIXES)
def test_metadata(written: dict, shape: str, mix: str) -> None:
    s = SHAPES[shape]
    r = GGUFReader(written[shape, mix])
    a = s.arch
    assert meta(r, "general.architecture") == a
    assert meta(r, f"{a}.block_count") == s.n_layers
    assert meta(r, f"{a}.context_length") == s.context_length
    assert meta(r, f"{a}.embedding_length") == s.d_model
    assert meta(r, f"{a}.feed_forward_length") == s.d_ff
    assert meta(r, f"{a}.attention.head_count") == s.n_heads
    assert meta(r, f"{a}.attention.head_count_kv") == s.n_kv_heads
    key_length = meta(r, f"{a}.attention.key_length")
    assert key_length == (s.head_dim if s.head_dim * s.n_heads != s.d_model else None)
    assert meta(r, f"{a}.rope.freq_base") == pytest.approx(s.rope_theta)
    assert meta(r, f"{a}.rope.dimension_count") == s.head_dim
    assert meta(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(s.norm_eps)
    assert meta(r, "general.file_type") == int(QUANT_MIXES[mix].file_type)
    assert meta(r, "general.quantization_version") == 2
    tokens = meta(r, "tokenizer.ggml.tokens")
    assert len(tokens) == s.vocab_size
    assert meta(r, "tokenizer.ggml.model") == "gpt2"
    assert meta(r, "tokenizer.ggml.pre") == ("llama-bpe" if a == "llama" else "qwen2")
    assert tokens[meta(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[meta(r, "tokenizer.ggml.fim_pre_token_id")] == "<|fim_prefix|>"
    assert tokens[meta(r, "tokenizer.ggml.fim_sep_token_id")] == "<|file_sep|>"
    assert "<|im_start|>" in meta(r, "tokenizer.chat_template")
    types = meta(r, "tokenizer.ggml.token_type")
    assert {types[tokens.index(t)] for t in SPECIAL_TOKENS} == {3}  # CONTROL
    assert meta(r, "tokenizer.ggml.merges")[0].count(" ") == 1


def _expected_names(shape: str) -> list[str]:
    s = SHAPES[shape]
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    per_layer += ["ffn_gate", "ffn_up", "ffn_down"]
    names = {"token_embd.weight", "output_norm.weight"}
    names |= {"output.weight"} if not s.tied_embeddings else set()
    names |= {"rope_freqs.weight"} if s.rope_scaling else set()
    extra = ["attn_q_norm", "attn_k_norm"] if s.qk_norm else []
    for i in range(s.n_layers):
        names |= {f"blk.{i}.{t}.weight" for t in per_layer + extra}
        if s.attn_bias:
            names |= {f"blk.{i}.attn_{x}.bias" for x in "qkv"}
    return sorted(names)


@pytest.mark.parametrize("shape", TINY)
@pytest.mark.parametrize("mix", MIXES)
def test_tensors(written: dict, shape: str, mix: str) -> None:
    s = SHAPES[shape]
    r = GGUFReader(written[shape, mix])
    by_name = {t.name: t for t in r.tensors}
    assert sorted(by_name) == _expected_names(shape)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    ne = {"attn_q": [s.d_model, q], "attn_k": [s.d_model, kv], "attn_output": [q, s.d_model]}
    ne |= {"ffn_up": [s.d_model, s.d_ff], "ffn_down": [s.d_ff, s.d_model]}
    for key, dims in ne.items():
        assert by_name[f"blk.0.{key}.weight"].shape.tolist() == dims  # ne0 = input features
    assert by_name["token_embd.weight"].shape.tolist() == [s.d_model, s.vocab_size]
    for t in r.tensors:
        if t.name.endswith(("_norm.weight", ".bias")) or t.name == "rope_freqs.weight":
            assert t.tensor_type == T.F32, t.name
        elif mix == "f16":
            assert t.tensor_type == T.F16, t.name
        x = quants.dequantize(t.data, t.tensor_type).reshape(-1)
        assert np.isfinite(x).all(), t.name
        if t.name.endswith("_norm.weight"):
            assert abs(float(x.mean()) - 1.0) < 0.1, t.name
        elif t.name.endswith(".weight") and t.name != "rope_freqs.weight":
            assert 0.005 < float(x.std()) < 0.1, (t.name, float(x.std()))


@pytest.mark.parametrize("mix", sorted(set(QUANT_MIXES) - set(MIXES)))
def test_every_other_mix(tmp_path: Path, mix: str) -> None:
    path = write_synthetic(tmp_path / "m.gguf", "tiny-qwen2", mix, progress=False)
    r = GGUFReader(path)
    assert meta(r, "general.file_type") == int(QUANT_MIXES[mix].file_type)
    specs = {spec.name: spec for spec in tensor_specs("tiny-qwen2", mix)}
    for t in r.tensors:
        assert t.tensor_type == specs[t.name].qtype, t.name
        x = quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(x).all(), t.name
        if t.name.endswith("attn_q.weight"):
            assert 0.005 < float(x.std()) < 0.1, (t.name, float(x.std()))


def test_q4_k_m_per_layer_choices(written: dict) -> None:
    """tiny-llama (4 layers): use_more_bits picks layers 2 and 3; tiny-qwen2's ffn_down rows (640)
    do not divide 256, so its Q4_K/Q6_K fall back to Q5_0/Q8_0; tied embeddings take Q6_K."""
    types = {t.name: t.tensor_type for t in GGUFReader(written["tiny-llama", "q4_k_m"]).tensors}
    for i, more in enumerate([False, False, True, True]):
        for key in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{key}.weight"] == (T.Q6_K if more else T.Q4_K)
        assert types[f"blk.{i}.attn_q.weight"] == T.Q4_K
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K
    types = {t.name: t.tensor_type for t in GGUFReader(written["tiny-qwen2", "q4_k_m"]).tensors}
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [T.Q5_0, T.Q5_0, T.Q8_0]
    assert types["blk.2.attn_v.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q6_K
    types = {t.name: t.tensor_type for t in GGUFReader(written["tiny-qwen3", "q6_k"]).tensors}
    assert types["output.weight"] == T.Q6_K and types["blk.1.ffn_down.weight"] == T.Q6_K


def test_llama3_rope_factors_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = SHAPES["llama3.2-1b"]
    params = {k: v for k, v in s.rope_scaling.items() if k != "type"}
    config = LlamaConfig(
        hidden_size=s.d_model,
        num_attention_heads=s.n_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.context_length,
        rope_parameters={"rope_type": "llama3", "rope_theta": s.rope_theta, **params},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2) / s.head_dim)
    np.testing.assert_allclose(base / scaled.numpy(), llama3_rope_factors(s), rtol=1e-5)


def test_rope_freqs_tensor(written: dict) -> None:
    r = GGUFReader(written["tiny-llama", "q8_0"])
    (t,) = [t for t in r.tensors if t.name == "rope_freqs.weight"]
    np.testing.assert_allclose(t.data, llama3_rope_factors(SHAPES["tiny-llama"]), rtol=1e-6)


def test_same_seed_same_bytes(written: dict, tmp_path: Path) -> None:
    again = write_synthetic(tmp_path / "a.gguf", "tiny-qwen3", "q4_k_m", seed=0, progress=False)
    assert again.read_bytes() == written["tiny-qwen3", "q4_k_m"].read_bytes()
    other = write_synthetic(tmp_path / "b.gguf", "tiny-qwen3", "q4_k_m", seed=1, progress=False)
    assert other.read_bytes() != again.read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_smollm2_shape_matches_the_real_file(smollm2_path: Path, tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "smol.gguf", "smollm2-135m", "q8_0", progress=False)
    synth, real = GGUFReader(path), GGUFReader(smollm2_path)
    shapes = {t.name: t.shape.tolist() for t in synth.tensors}
    assert shapes == {t.name: t.shape.tolist() for t in real.tensors}
    assert {t.tensor_type for t in synth.tensors} == {T.Q8_0, T.F32}
    assert meta(synth, "general.file_type") == LlamaFileType.MOSTLY_Q8_0
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
                "vocab_size"):  # fmt: skip
        assert meta(synth, f"llama.{key}") == meta(real, f"llama.{key}"), key
    assert meta(synth, "llama.rope.freq_base") == meta(real, "llama.rope.freq_base")
    assert meta(synth, "tokenizer.ggml.pre") == meta(real, "tokenizer.ggml.pre") == "smollm"
    assert len(meta(synth, "tokenizer.ggml.tokens")) == len(meta(real, "tokenizer.ggml.tokens"))


def test_tensor_specs_sizes_add_up(written: dict) -> None:
    path = written["tiny-llama", "q4_k_m"]
    data = sum(spec.nbytes for spec in tensor_specs("tiny-llama", "q4_k_m"))
    assert data < path.stat().st_size < data + 2_000_000  # header: tokens, merges, padding


TEXTS = [
    "Hello, world! The quick brown fox jumps over 12345 lazy dogs.",
    "def f(x):\n    return {'a': x ** 2}  # ünïcödé, 日本語, emoji 🦙\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.parametrize("shape", TINY)
def test_tokenizer_round_trip(written: dict, shape: str) -> None:
    if importlib.util.find_spec("hetero.tokenizer") is None:
        pytest.skip("hetero.tokenizer is not written yet (another engineer's module)")
    from hetero.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(written[shape, "q8_0"])
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges really compress
