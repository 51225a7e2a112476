"""Llama-family architectures by name: the public configs of real models, and tiny test shapes.

`ModelShape` holds what a GGUF file's metadata and tensor shapes need; `SHAPES` names the ones
`hetero synth` can write. Numbers for real models come from their published `config.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ARCHES = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
MOE_ARCHES = ("qwen3moe", "gpt-oss")

# Pre-tokenizer (tokenizer.ggml.pre) the synthetic vocabulary declares, by family (gpt-oss's own
# o200k vocabulary is not trained here: its synthetic files take qwen2's splitting)
PRE_BY_ARCH = {
    "llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2",
    "gpt-oss": "qwen2",
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A llama-family architecture (llama, mistral, qwen2, qwen3 differ only by these flags)."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool
    attn_bias: bool = False  # qwen2: biases on q, k and v
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k
    rope_scaling: dict[str, Any] | None = None  # {"type": "llama3" | "linear" | "yarn", ...}
    pre: str | None = None  # tokenizer.ggml.pre; None: the family's default
    # mixture of experts (qwen3moe, gpt-oss): E experts of width d_ff_expert, k chosen a token
    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_expert: int = 0
    sliding_window: int = 0  # gpt-oss: the window of every other layer, from the first

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"unknown arch {self.arch!r}; known: {', '.join(ARCHES)}")
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if (self.arch in MOE_ARCHES) != (self.n_experts > 0):
            raise ValueError(f"{self.arch}: n_experts must be > 0 exactly for {MOE_ARCHES}")
        if self.n_experts and not 1 <= self.n_experts_used <= self.n_experts:
            raise ValueError(f"n_experts_used {self.n_experts_used} not in 1..{self.n_experts}")
        if self.n_experts and self.d_ff_expert <= 0:
            raise ValueError(f"d_ff_expert must be positive, got {self.d_ff_expert}")
        kind = (self.rope_scaling or {}).get("type")
        if self.rope_scaling is not None and kind not in ("llama3", "linear", "yarn"):
            raise ValueError(f"rope_scaling type {kind!r} not one of llama3, linear, yarn")

    @property
    def tokenizer_pre(self) -> str:
        return self.pre or PRE_BY_ARCH[self.arch]

    @property
    def n_gqa(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.d_model * (q + 2 * kv) + q * self.d_model
        ffn = 3 * self.d_model * self.d_ff
        if self.n_experts:
            ffn = self.n_experts * (3 * self.d_model * self.d_ff_expert + self.d_model)
        layer = attn + ffn + 2 * self.d_model
        embd = self.vocab_size * self.d_model * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embd + self.d_model


def llama3_rope_factors(shape: ModelShape) -> list[float]:
    """llama.cpp's `rope_freqs.weight` for llama3 scaling: one divisor per rotary pair.

    Wavelengths shorter than original_ctx/high_freq_factor keep their frequency (factor 1),
    longer than original_ctx/low_freq_factor are slowed by `factor`, and the band between
    interpolates smoothly (as convert_hf_to_gguf computes it).
    """
    scaling = shape.rope_scaling or {}
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    factors = []
    for i in range(0, shape.head_dim, 2):
        wavelen = 2 * math.pi * shape.rope_theta ** (i / shape.head_dim)
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return factors


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _llama(**kw: Any) -> ModelShape:
    base: dict[str, Any] = dict(arch="llama", rope_theta=500000.0, norm_eps=1e-5)
    return ModelShape(**{**base, **kw})


def _qwen(arch: str, **kw: Any) -> ModelShape:
    base: dict[str, Any] = dict(arch=arch, rope_theta=1000000.0, norm_eps=1e-6)
    return ModelShape(**{**base, **kw})


def _gpt_oss(**kw: Any) -> ModelShape:
    """gpt-oss: YaRN x32 over 4096 positions, window 128 on every other layer, 64-wide heads."""
    base: dict[str, Any] = dict(
        arch="gpt-oss", rope_theta=150000.0, norm_eps=1e-5, head_dim=64, n_kv_heads=8,
        vocab_size=201088, context_length=131072, tied_embeddings=False, attn_bias=True,
        sliding_window=128,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
    )  # fmt: skip
    return ModelShape(**{**base, **kw})


_L3 = dict(vocab_size=128256, context_length=131072)
_QW = dict(vocab_size=151936)

SHAPES: dict[str, ModelShape] = {
    # Meta-Llama-3-8B (8k context, no scaling) and Llama-3.1-8B (128k, llama3 scaling x8).
    "llama3-8b": _llama(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
        vocab_size=128256, context_length=8192, tied_embeddings=False,
    ),
    "llama3.1-8b": _llama(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
        tied_embeddings=False, rope_scaling=_llama3_scaling(8.0), **_L3,
    ),
    "llama3.2-1b": _llama(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192,
        tied_embeddings=True, rope_scaling=_llama3_scaling(32.0), **_L3,
    ),
    "llama3.2-3b": _llama(
        n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, head_dim=128, d_ff=8192,
        tied_embeddings=True, rope_scaling=_llama3_scaling(32.0), **_L3,
    ),
    # Meta-Llama-3.1-70B(-Instruct): the size offices plan a GPU + CPU split for.
    "llama3.1-70b": _llama(
        n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=28672,
        tied_embeddings=False, rope_scaling=_llama3_scaling(8.0), **_L3,
    ),
    # Mistral-7B-v0.3 (llama architecture in GGUF).
    "mistral-7b": _llama(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
        vocab_size=32768, context_length=32768, rope_theta=1000000.0, tied_embeddings=False,
    ),
    "qwen2.5-0.5b": _qwen(
        "qwen2", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864,
        context_length=32768, tied_embeddings=True, attn_bias=True, **_QW,
    ),
    "qwen2.5-7b": _qwen(
        "qwen2", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, head_dim=128, d_ff=18944,
        vocab_size=152064, context_length=32768, tied_embeddings=False, attn_bias=True,
    ),
    # Qwen2.5-14B/32B(-Instruct); the Coder models have the same shapes (names below).
    "qwen2.5-14b": _qwen(
        "qwen2", n_layers=48, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128, d_ff=13824,
        vocab_size=152064, context_length=32768, tied_embeddings=False, attn_bias=True,
    ),
    "qwen2.5-32b": _qwen(
        "qwen2", n_layers=64, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128, d_ff=27648,
        vocab_size=152064, context_length=32768, tied_embeddings=False, attn_bias=True,
    ),
    "qwen3-0.6b": _qwen(
        "qwen3", n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072,
        context_length=40960, tied_embeddings=True, qk_norm=True, **_QW,
    ),
    "qwen3-8b": _qwen(
        "qwen3", n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
        context_length=40960, tied_embeddings=False, qk_norm=True, **_QW,
    ),
    # Qwen3-30B-A3B and Qwen3-Coder-30B-A3B (the same shapes; Coder's context is 262144)
    "qwen3-30b-a3b": _qwen(
        "qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
        d_ff=6144, n_experts=128, n_experts_used=8, d_ff_expert=768, context_length=40960,
        tied_embeddings=False, qk_norm=True, **_QW,
    ),
    "gpt-oss-20b": _gpt_oss(
        n_layers=24, d_model=2880, n_heads=64, d_ff=2880, n_experts=32, n_experts_used=4,
        d_ff_expert=2880,
    ),
    "gpt-oss-120b": _gpt_oss(
        n_layers=36, d_model=2880, n_heads=64, d_ff=2880, n_experts=128, n_experts_used=4,
        d_ff_expert=2880,
    ),
    "qwen3-14b": _qwen(
        "qwen3", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128, d_ff=17408,
        context_length=40960, tied_embeddings=False, qk_norm=True, **_QW,
    ),
    "qwen3-32b": _qwen(
        "qwen3", n_layers=64, d_model=5120, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=25600,
        context_length=40960, tied_embeddings=False, qk_norm=True, **_QW,
    ),
    "smollm2-135m": _llama(
        n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
        vocab_size=49152, context_length=8192, rope_theta=100000.0, tied_embeddings=True,
        pre="smollm",
    ),
    "smollm2-360m": _llama(
        n_layers=32, d_model=960, n_heads=15, n_kv_heads=5, head_dim=64, d_ff=2560,
        vocab_size=49152, context_length=8192, rope_theta=100000.0, tied_embeddings=True,
        pre="smollm",
    ),
    # Tiny test shapes: d_model 256 so K-quants fit, GQA, a few thousand tokens. tiny-qwen2's
    # d_ff 640 does not divide 256, so its ffn_down exercises the per-tensor fallback; tiny-qwen3
    # has head_dim != d_model / n_heads (key_length metadata) like the real Qwen3.
    "tiny-llama": _llama(
        n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
        vocab_size=4096, context_length=2048, tied_embeddings=False,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "tiny-qwen2": _qwen(
        "qwen2", n_layers=3, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=640,
        vocab_size=3072, context_length=2048, tied_embeddings=True, attn_bias=True,
    ),
    "tiny-qwen3": _qwen(
        "qwen3", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=768,
        vocab_size=4096, context_length=2048, tied_embeddings=False, qk_norm=True,
    ),
    # Tiny MoE shapes: 8 experts, 2 a token, widths that K-quants divide (gpt-oss's real 2880
    # does not: its K-quant tensors fall back per tensor, as llama.cpp's do)
    "tiny-qwen3moe": _qwen(
        "qwen3moe", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
        n_experts=8, n_experts_used=2, d_ff_expert=512, vocab_size=4096, context_length=2048,
        tied_embeddings=False, qk_norm=True,
    ),
    "tiny-gpt-oss": _gpt_oss(
        n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, n_experts=8,
        n_experts_used=2, d_ff_expert=512, vocab_size=4096, context_length=2048,
        sliding_window=8,
    ),
}  # fmt: skip
SHAPES["qwen2.5-coder-14b"] = SHAPES["qwen2.5-14b"]
SHAPES["qwen2.5-coder-32b"] = SHAPES["qwen2.5-32b"]


def get_shape(shape: str | ModelShape) -> ModelShape:
    if isinstance(shape, ModelShape):
        return shape
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]
