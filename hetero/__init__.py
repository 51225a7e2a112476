"""hetero: LLM inference for the GPUs (and CPUs) that offices actually own."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazy: `import hetero` stays cheap (no torch) for the command line's --help and --version.
    if name == "LLM":
        from hetero.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hetero.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from hetero.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
