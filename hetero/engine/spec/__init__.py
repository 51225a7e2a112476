"""Speculative decoding: guess several tokens, verify them in one target pass.

ngram.py (prompt lookup and an engine-wide n-gram cache), draft.py (a small draft model),
adapt.py (per-request k, n and off-switch), verify.py (the acceptance rule), speculator.py (the
engine's hook around schedule/update).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetero.engine.engine import Engine


# "auto" guesses only while at most this many requests decode (engine/config.py says why)
SPEC_AUTO_MAX_DECODES = 4
# On CUDA a verify step replays the decode graphs (cuda_graph.py: 1 + k rows a request) but with
# one stream it leaves the GEMV kernels for the tensor-core ones, ~1.6x the time per linear on an
# H200 (T=1 22.6 us, T=2..16 ~36 us, Q4_K 4096x14336: BENCHMARKS.md). So there a request keeps
# guessing only while its verified steps average more than 0.6 accepted tokens (adapt.py).
SPEC_CUDA_MIN_GAIN = 0.6


def make_speculator(engine: Engine):
    """The speculator an engine's config asks for, or None when speculation is off."""
    cfg = engine.config
    auto = cfg.speculative == "auto"
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "ngram" or auto:
        from hetero.engine.spec.speculator import NgramSpeculator

        spec = NgramSpeculator(cfg.num_speculative_tokens)
        spec.max_decodes = SPEC_AUTO_MAX_DECODES if auto else None
        if engine.runtime.device.startswith("cuda"):
            spec.adapt = replace(spec.adapt, min_gain=SPEC_CUDA_MIN_GAIN)
        return spec
    from hetero.engine.spec.draft import DraftSpeculator

    return DraftSpeculator(engine)
