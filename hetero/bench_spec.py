"""Speculative decoding A/B: each workload and concurrency with guesses off, then on.

One loaded engine serves every run (on a GPU the load and the graph capture dominate a short
run); a short run of each workload and concurrency warms it up first. Before each run the
prefix cache is emptied, so both sides prefill their prompts, and the n-gram speculator starts
fresh (no n-grams of the runs before). Each pair prints one line:

    WORKLOAD c=C: off A tok/s | MODE B tok/s, (B/A)x; accepted a/p (a/p %);
        step ms: plain T (R rows), verify T (R rows)

tok/s is output tokens over the run's wall time; the step times are decode-only steps of the
run with guesses (plain: no request guessed that step; verify: some did), which price a verify
step against a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.bench import BenchResult, run_bench
from hetero.engine.engine import Engine
from hetero.engine.spec import make_speculator


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
            f"{self.workload} c={self.concurrency}: off {self.off.output_tok_s:.1f} tok/s | "
            f"{on.spec_mode} {on.output_tok_s:.1f} tok/s, {self.speedup:.2f}x; accepted "
            f"{on.spec_accepted}/{on.spec_proposed} ({on.acceptance_rate:.0%}); step ms: "
            f"plain {_per_step(self.plain)}, verify {_per_step(self.verify)}"
        )


def _per_step(kind: tuple[int, int, float]) -> str:
    steps, rows, seconds = kind
    if not steps:
        return "-"
    return f"{seconds / steps * 1e3:.2f} ({rows / steps:.1f} rows)"


def _fresh_speculator(engine: Engine, spec):
    """A new n-gram speculator (empty cache); a draft model's is kept (it holds no n-grams)."""
    if engine.config.speculative in ("ngram", "auto"):
        return make_speculator(engine)
    return spec


def spec_ab(
    engine: Engine,
    workloads: list[str],
    concurrencies: list[int],
    input_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SpecPair]:
    """Every (workload, concurrency): c requests at once, speculation off then on."""
    spec = engine.spec
    if spec is None:
        raise ValueError("speculative decoding is off: pass --speculative ngram, auto or draft")
    pairs = []
    try:
        for workload in workloads:  # warm-up at the measured shapes (kernels compile lazily)
            for c in concurrencies:
                run_bench(engine, c, c, input_len, 4, seed, workload=workload)
        for workload in workloads:
            for c in concurrencies:
                runs = []
                for on in (False, True):
                    engine.spec = _fresh_speculator(engine, spec) if on else None
                    engine.block_manager.reset_prefix_cache()
                    before = [list(engine.stats.decode), list(engine.stats.verify)]
                    r = run_bench(engine, c, c, input_len, output_len, seed, workload=workload)
                    runs.append(r)
                plain, verify = (
                    tuple(a - b for a, b in zip(now, was))
                    for now, was in zip((engine.stats.decode, engine.stats.verify), before)
                )
                pairs.append(SpecPair(workload, c, runs[0], runs[1], plain, verify))
    finally:
        engine.spec = spec
    return pairs
