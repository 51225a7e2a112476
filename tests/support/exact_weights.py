"""The weights of tests that compare outputs across batch shapes.

Batching, prefix hits, chunked prefill, guesses and pipeline stages change a step's shapes, and
with them the float rounding of its matmuls. With fp16 weights (near-exact) that stays in the
last bits of the logits. The CPU default (qdot, `--weights auto`) rounds activations to int8 per
32, which turns such noise into ~1e-2 logit steps, enough to flip a greedy near-tie; its accuracy
is measured against fp32 weights in BENCHMARKS.md instead. Tests that compare shapes therefore
load their models with these weights, through RuntimeConfig, LLM options or the daemon's flags.
"""

from __future__ import annotations

from hetero.config import RuntimeConfig

WEIGHTS = "fp16"
FLAGS = ("--weights", WEIGHTS)  # hetero-serve


def runtime(**options) -> RuntimeConfig:
    return RuntimeConfig(weights=WEIGHTS, **options)
