"""Speculative decoding: guess several tokens, verify them in one target pass.

ngram.py (prompt lookup and an engine-wide n-gram cache), draft.py (a small draft model),
adapt.py (per-request k, n and off-switch), verify.py (the acceptance rule), speculator.py (the
engine's hook around schedule/update).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetero.engine.engine import Engine


# "auto" guesses only while at most this many requests decode (engine/config.py says why)
SPEC_AUTO_MAX_DECODES = 4


def make_speculator(engine: Engine):
    """The speculator an engine's config asks for, or None when speculation is off."""
    cfg = engine.config
    auto = cfg.speculative == "auto"
    if cfg.speculative == "off" or (auto and engine.runtime.device.startswith("cuda")):
        return None
    if cfg.speculative == "ngram" or auto:
        from hetero.engine.spec.speculator import NgramSpeculator

        spec = NgramSpeculator(cfg.num_speculative_tokens)
        spec.max_decodes = SPEC_AUTO_MAX_DECODES if auto else None
        return spec
    from hetero.engine.spec.draft import DraftSpeculator

    return DraftSpeculator(engine)
