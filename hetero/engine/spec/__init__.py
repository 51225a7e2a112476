"""Speculative decoding: guess several tokens, verify them in one target pass.

ngram.py (prompt lookup and an engine-wide n-gram cache), draft.py (a small draft model),
adapt.py (per-request k, n and off-switch), verify.py (the acceptance rule), speculator.py (the
engine's hook around schedule/update).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hetero.engine.spec.draft import DraftSpeculator
from hetero.engine.spec.speculator import NgramSpeculator

if TYPE_CHECKING:
    from hetero.engine.config import EngineConfig
    from hetero.engine.executor import Executor, ExecutorInfo
    from hetero.engine.spec.adapt import AdaptConfig


# "auto" guesses only while at most this many requests decode (engine/config.py says why)
SPEC_AUTO_MAX_DECODES = 4
# What a one-stream verify step costs in plain decode steps on CUDA, by weights mode; a request
# keeps guessing only while its verified steps average more than cost - 1 accepted tokens
# (adapt.py). The steps replay the decode graphs (cuda_graph.py: 1 + k rows a request). Measured
# on an H200 with `hetero bench --spec-ab` (BENCHMARKS.md, issue 9 rows), one stream, ~9 rows:
#   quant  Llama-3-8B Q4_K_M: verify 6.66 ms vs plain 4.32 ms (1.54x): a plain step's T = 1 runs
#          the GEMV kernels, a verify step's T = 9 the tensor-core one
#   dense  SmolLM2-135M: verify 1.68-1.70 ms vs plain 1.50-1.57 ms (1.08-1.13x): cuBLAS reads
#          the weights once for T = 1 or 9
SPEC_CUDA_VERIFY_COST = {"quant": 1.55, "dense": 1.1}


def verify_cost(info: ExecutorInfo) -> float:
    """A verify step's cost in plain steps where it matters (1.0: priced in proportion, as on a
    CPU, where a step's time grows with its rows and the acceptance rule alone decides)."""
    if not info.device.startswith("cuda"):
        return 1.0
    return SPEC_CUDA_VERIFY_COST.get(info.weights, 1.0)


def priced(adapt: AdaptConfig, info: ExecutorInfo) -> AdaptConfig:
    """The per-request control for the engine's device: where a verify step costs more than a
    plain one but the same whatever its rows (CUDA: the tensor-core kernels take T = 3 .. 16 in
    the same time, and the graph bucket pads the rows anyway), guesses must pay for the step
    (min_gain) and a rejection does not shrink k (a shorter guess would save nothing)."""
    cost = verify_cost(info)
    if cost <= 1.0:
        return adapt
    return replace(adapt, min_gain=cost - 1.0, k_min=adapt.k_max)


def ngram_speculator(
    config: EngineConfig, info: ExecutorInfo, max_decodes: int | None
) -> NgramSpeculator:
    """N-gram guesses, the control priced for the executor's device (priced)."""
    spec = NgramSpeculator(config.num_speculative_tokens)
    spec.max_decodes = max_decodes
    spec.adapt = priced(spec.adapt, info)
    return spec


def make_speculator(
    config: EngineConfig, info: ExecutorInfo, params: dict, draft: Executor | None = None
):
    """The speculator the config asks for, or None when speculation is off or the executor
    samples elsewhere (a pipeline samples in its last stage: plain decode steps there).
    `params`: the engine's live map of request id -> SamplingParams; `draft`: the draft
    model's executor (speculative "draft")."""
    mode = config.speculative
    if mode == "off" or info.samples:
        return None
    if mode in ("ngram", "auto"):
        return ngram_speculator(config, info, SPEC_AUTO_MAX_DECODES if mode == "auto" else None)
    if draft is None:
        raise ValueError("speculative 'draft' needs the draft model's executor")
    return DraftSpeculator(config, draft, params)
