"""Speculative decoding A/B: each workload and concurrency with guesses off, then on.

One loaded engine serves every run (on a GPU the load and the graph capture dominate a short
run); a short run of each workload and concurrency warms it up first. Before each run the
prefix cache is emptied, so both sides prefill their prompts, and the n-gram speculator starts
fresh (no n-grams of the runs before). The "on" side is the configured mode, and under "auto"
plain "ngram" too (auto stops guessing past a few decoding requests), and optionally oracles
of set acceptance (OracleSpeculator: for models with random weights). Each prints one line:

    WORKLOAD c=C MODE: off A tok/s, on B tok/s, (B/A)x; accepted a/p (a/p %);
        step ms: plain T (R rows), verify T (R rows)

tok/s is output tokens over the run's wall time; the step times are decode-only steps of the
run with guesses (plain: no request guessed that step; verify: some did), which price a verify
step against a plain one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hetero.bench import BenchResult, run_bench
from hetero.engine.engine import Engine
from hetero.engine.request import Request
from hetero.engine.spec import SPEC_AUTO_MAX_DECODES, ngram_speculator, priced
from hetero.engine.spec.speculator import Speculator


@dataclass
class SpecPair:
    workload: str
    concurrency: int
    off: BenchResult
    on: BenchResult
    plain: tuple[int, int, float]  # decode steps without guesses in the on run: steps, rows, s
    verify: tuple[int, int, float]  # with guesses

    @property
    def speedup(self) -> float:
        return self.on.output_tok_s / self.off.output_tok_s if self.off.output_tok_s else 0.0

    def line(self) -> str:
        on = self.on
        return (
            f"{self.workload} c={self.concurrency} {on.spec_mode}: off "
            f"{self.off.output_tok_s:.1f} tok/s, on {on.output_tok_s:.1f} tok/s, "
            f"{self.speedup:.2f}x; accepted {on.spec_accepted}/{on.spec_proposed} "
            f"({on.acceptance_rate:.0%}); step ms: plain {_per_step(self.plain)}, "
            f"verify {_per_step(self.verify)}"
        )


def _per_step(kind: tuple[int, int, float]) -> str:
    steps, rows, seconds = kind
    if not steps:
        return "-"
    return f"{seconds / steps * 1e3:.2f} ({rows / steps:.1f} rows)"


class OracleSpeculator(Speculator):
    """Guesses from the recorded answers of the run without speculation: each guessed token is
    the recorded one with probability p, else a wrong one. The acceptance is then set by p, not
    by how a model copies its prompt: a model with random weights (`hetero synth`) copies
    nothing, so only this shows what a verify step of a given acceptance costs and pays on its
    shapes (p = 1: an answer that copies throughout; p = 0: every guess wrong, the worst case,
    which the off-switch must bound). Same per-request control as the n-gram speculator."""

    def __init__(self, engine: Engine, answers: dict[str, list[int]], p: float) -> None:
        super().__init__(engine.config.num_speculative_tokens)
        self.adapt = priced(self.adapt, engine.executor.info)
        self.answers, self.p = answers, p
        self.vocab = engine.model_config.vocab_size
        self.rng = random.Random(0)

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        out = {}
        for req, state in self.active(requests):
            n = len(req.output_ids)
            want = self.answers.get(req.request_id, [])[n : n + state.k]
            guess = [t if self.rng.random() < self.p else (t + 1) % self.vocab for t in want]
            if guess:
                out[req.request_id] = guess
        return out


def speculators(engine: Engine) -> dict[str, Callable[[], object]]:
    """The "on" sides, each a maker of a fresh speculator (an n-gram one starts with an empty
    cache; a draft model's is kept): the configured mode, and under "auto" also plain "ngram"
    (guessing at any batch size), which shows what the auto limit saves or costs."""
    mode, spec = engine.config.speculative, engine.spec
    if spec is None:
        raise ValueError("speculative decoding is off: pass --speculative ngram, auto or draft")
    if mode == "draft":
        return {"draft": lambda: spec}
    out = {"ngram": lambda: ngram_speculator(engine.config, engine.executor.info, None)}
    if mode == "auto":
        out = {
            "auto": lambda: ngram_speculator(
                engine.config, engine.executor.info, SPEC_AUTO_MAX_DECODES
            ),
            **out,
        }
    return out


def _run(engine: Engine, c, input_len, output_len, seed, workload, outputs=None):
    """One measured run from an empty prefix cache; with the decode step counters it moved."""
    engine.block_manager.reset_prefix_cache()
    before = [list(engine.stats.decode), list(engine.stats.verify)]
    r = run_bench(engine, c, c, input_len, output_len, seed, workload=workload, outputs=outputs)
    now = (engine.stats.decode, engine.stats.verify)
    plain, verify = (tuple(a - b for a, b in zip(n, w)) for n, w in zip(now, before))
    return r, plain, verify


def spec_ab(
    engine: Engine,
    workloads: list[str],
    concurrencies: list[int],
    input_len: int,
    output_len: int,
    seed: int = 0,
    oracles: tuple[float, ...] = (),
) -> list[SpecPair]:
    """Every (workload, concurrency): c requests at once, speculation off, then each "on" mode
    (and an OracleSpeculator per probability in `oracles`)."""
    spec, makers = engine.spec, speculators(engine)
    pairs = []
    try:
        for workload in workloads:  # warm-up at the measured shapes (kernels compile lazily)
            for c in concurrencies:
                run_bench(engine, c, c, input_len, 4, seed, workload=workload)
        for workload in workloads:
            for c in concurrencies:
                engine.spec, answers = None, {}
                off, _, _ = _run(engine, c, input_len, output_len, seed, workload, answers)
                modes = dict(makers)
                for p in oracles:
                    modes[f"oracle-{p:.0%}"] = lambda p=p, a=answers: OracleSpeculator(engine, a, p)
                for mode, make in modes.items():
                    engine.spec = make()
                    on, plain, verify = _run(engine, c, input_len, output_len, seed, workload)
                    on.spec_mode = mode
                    pairs.append(SpecPair(workload, c, off, on, plain, verify))
    finally:
        engine.spec = spec
    return pairs
