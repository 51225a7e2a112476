"""The engine's TokenLogprobs in the OpenAI API's two shapes (chat, and legacy completions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hetero.engine.output import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this for impossible tokens


def token_text(tokenizer, token_id: int) -> str:
    """The token's own text (a piece of a character shows as U+FFFD; `bytes` has it exactly)."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": token_text(tokenizer, token_id),
        "logprob": _finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat(tokenizer, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}]} for chat choices."""
    content = []
    for t in logprobs or ():
        entry = _entry(tokenizer, t.token_id, t.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, i, x) for i, x in t.top]
        content.append(entry)
    return {"content": content}


def legacy(tokenizer, logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset} for /v1/completions.

    `offset` is where the first token's text starts in the choice's text (after an echo).
    """
    tokens, values, tops, offsets = [], [], [], []
    for t in logprobs:
        text = token_text(tokenizer, t.token_id)
        tokens.append(text)
        values.append(_finite(t.logprob))
        tops.append({token_text(tokenizer, i): _finite(x) for i, x in t.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
