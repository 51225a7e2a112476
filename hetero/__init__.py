"""hetero: LLM inference for the GPUs (and CPUs) that offices actually own."""

from __future__ import annotations

__version__ = "0.1.0"
