"""What JSON mode costs per step: building a vocabulary's tries, and a token mask per state.

    python benchmarks/json_mask.py [MODEL] [--repeats 20]

1. Building `JsonVocab` (token bytes, the byte trie, the in-string suffix trie): time, memory.
2. A mask per kind of grammar state, the cache cleared before each (median and min of repeats).
3. Stepping through a real pretty-printed object token by token from a cold cache: mean and max
   ms per step, and with the cache warm.

Masks are CPU work on the engine thread, before the sampler; the sampler's masked_fill is not
counted here.
"""

from __future__ import annotations

import json
import statistics
import time
import tracemalloc

import click

from hetero.engine.json_grammar import (
    AFTER,
    HEX_VAL,
    INITIAL,
    N_INT,
    STR_VAL,
    VALUE,
)
from hetero.engine.json_mask import JsonConstraint, JsonVocab
from hetero.models import resolve_model
from hetero.tokenizer import Tokenizer

STATES = {
    "start": INITIAL,
    "value": (VALUE, 0, "{"),
    "after a value": (AFTER, 0, "{["),
    "inside a string": (STR_VAL, 0, "{"),
    "inside a number": (N_INT, 1, "{"),
    "inside \\uXXXX": (HEX_VAL, 1, "{"),
}
SAMPLE = {"name": "Ada", "tags": ["x", "y\u00e9"], "n": [1, -2.5e3, True, None], "o": {"k": []}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


@click.command()
@click.argument("model", required=False)
@click.option("--repeats", type=click.IntRange(1), default=20, show_default=True)
def main(model: str | None, repeats: int) -> None:
    tok = Tokenizer.from_gguf(resolve_model(model))
    t = time.perf_counter()
    vocab = JsonVocab.from_tokenizer(tok, tok.vocab_size)
    build = time.perf_counter() - t
    tracemalloc.start()  # a second build for its memory (tracing slows it several times)
    again = JsonVocab.from_tokenizer(tok, tok.vocab_size)
    mem = tracemalloc.get_traced_memory()[0] / 1e6
    del again
    tracemalloc.stop()
    click.echo(f"vocabulary {tok.vocab_size} tokens: tries built in {build:.2f} s, {mem:.0f} MB")
    for name, state in STATES.items():
        times = []
        for _ in range(repeats):
            vocab._cache.clear()
            t = time.perf_counter()
            allowed = int(vocab.mask(state).sum())
            times.append(time.perf_counter() - t)
        med, low = statistics.median(times), min(times)
        click.echo(f"  {name:16s} {allowed:6d} allowed  median {ms(med)}  min {ms(low)}")
    ids = tok.encode(json.dumps(SAMPLE, indent=2, ensure_ascii=False))
    for label, clear in (("cold cache", True), ("warm cache", False)):
        if clear:
            vocab._cache.clear()
        c, times = JsonConstraint(vocab), []
        for token in ids:
            t = time.perf_counter()
            c.mask()
            times.append(time.perf_counter() - t)
            c.accept(token)
        mean, top = statistics.mean(times), max(times)
        click.echo(f"  {len(ids)}-token object, {label}: mean {ms(mean)}, max {ms(top)} per step")


if __name__ == "__main__":
    main()
