"""Which model class serves a GGUF architecture: one file per family (model/llama.py serves
llama, qwen2 and qwen3 by flags; the mixture-of-experts families have a file each)."""

from __future__ import annotations

from hetero.config import SUPPORTED_ARCHITECTURES


def model_class(arch: str) -> type:
    """The LlamaModel (sub)class for `arch` (imported on first use)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"architecture {arch!r} is not supported; supported: {known}")
    if arch == "qwen3moe":
        from hetero.model.qwen3moe import Qwen3MoeModel

        return Qwen3MoeModel
    if arch == "gpt-oss":
        from hetero.model.gpt_oss import GptOssModel

        return GptOssModel
    from hetero.model.llama import LlamaModel

    return LlamaModel
