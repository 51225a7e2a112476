"""Speculative decoding: guess several tokens, verify them in one target pass.

ngram.py (prompt lookup and an engine-wide n-gram cache), draft.py (a small draft model),
adapt.py (per-request k, n and off-switch), verify.py (the acceptance rule), speculator.py (the
engine's hook around schedule/update).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetero.engine.engine import Engine


def make_speculator(engine: Engine):
    """The speculator an engine's config asks for, or None when speculation is off."""
    cfg = engine.config
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "ngram":
        from hetero.engine.spec.speculator import NgramSpeculator

        return NgramSpeculator(cfg.num_speculative_tokens)
    from hetero.engine.spec.draft import DraftSpeculator

    return DraftSpeculator(engine)
