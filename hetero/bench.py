"""Offline benchmark: N requests of given input/output lengths, C in flight at once.

Closed loop: C requests start together; whenever one finishes the next waiting one starts, until
N are done. Prompts are random token ids (seeded) and outputs ignore EOS, so every request has
exactly the asked lengths. Reports output tok/s, TTFT and inter-token latency percentiles.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from hetero.bench_workloads import make_prompts
from hetero.engine.engine import Engine
from hetero.sampling import SamplingParams


@dataclass
class Timeline:
    start: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each output token


@dataclass
class BenchResult:
    num_requests: int
    concurrency: int
    input_len: int
    output_len: int
    wall_s: float
    ttft_s: list[float]
    itl_s: list[float]
    output_tokens: int
    prompt_tokens: int
    workload: str = "random"
    spec_proposed: int = 0  # speculative tokens guessed (0 when speculation is off)
    spec_accepted: int = 0
    spec_mode: str = "off"
    steps: int = 0  # engine steps the run took (0: not counted, as over HTTP)
    overlapped_steps: int = 0  # of them, settled while the next ran (engine/overlap.py)

    @classmethod
    def from_timelines(
        cls,
        timelines,
        num_requests,
        concurrency,
        input_len,
        output_len,
        wall,
        output_tokens: int | None = None,
    ) -> BenchResult:
        """Percentiles from per-request token arrival times (shared by the offline and HTTP
        benchmarks, so both report the same quantities)."""
        tls = list(timelines)
        return cls(
            num_requests,
            concurrency,
            input_len,
            output_len,
            wall,
            [tl.tokens[0] - tl.start for tl in tls if tl.tokens],
            [b - a for tl in tls for a, b in zip(tl.tokens, tl.tokens[1:])],
            sum(len(tl.tokens) for tl in tls) if output_tokens is None else output_tokens,
            input_len * num_requests,
        )

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def per_stream_tok_s(self) -> float:
        """Decode speed one stream sees: 1 / median inter-token latency. Where a step delivers
        several tokens (speculative decoding) most intervals are 0 and the median with them: then
        1 / mean, which spreads each step's time over its tokens."""
        if not self.itl_s:
            return 0.0
        itl = statistics.median(self.itl_s) or statistics.fmean(self.itl_s)
        return 1.0 / itl if itl > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    def spec_line(self) -> str:
        return (
            f"speculative {self.spec_mode}: proposed {self.spec_proposed}, accepted "
            f"{self.spec_accepted} ({self.acceptance_rate:.0%})"
        )

    def steps_line(self) -> str:
        return (
            f"engine steps {self.steps}, {self.overlapped_steps} overlapped (the host's work "
            "while the next step ran)"
        )

    def lines(self) -> list[str]:
        return [
            f"{self.workload}: requests {self.num_requests} x (in {self.input_len}, out "
            f"{self.output_len}), concurrency {self.concurrency}, wall {self.wall_s:.2f} s",
            f"output {self.output_tok_s:.1f} tok/s aggregate, "
            f"{self.per_stream_tok_s:.1f} tok/s per stream (1 / median ITL); "
            f"total {(self.output_tokens + self.prompt_tokens) / self.wall_s:.1f} tok/s",
            "TTFT ms   " + _pcts(self.ttft_s),
            "ITL ms    " + _pcts(self.itl_s),
        ]


def _pcts(xs: list[float]) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    pick = {p: s[min(len(s) - 1, int(p / 100 * len(s)))] * 1e3 for p in (50, 90, 99)}
    mean = statistics.fmean(xs) * 1e3
    return f"mean {mean:.1f}  p50 {pick[50]:.1f}  p90 {pick[90]:.1f}  p99 {pick[99]:.1f}"


def run_bench(
    engine: Engine,
    num_requests: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    params: SamplingParams | None = None,
    workload: str = "random",
    outputs: dict[str, list[int]] | None = None,
) -> BenchResult:
    """`outputs`, when given, collects each request's output token ids by request id."""
    prompts = make_prompts(engine, workload, num_requests, input_len, seed)
    ignore_eos = workload == "random"  # text workloads end where the model ends them
    params = params or SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=ignore_eos)
    spec = engine.spec
    spec0 = (0, 0) if spec is None else (spec.proposed, spec.accepted)
    steps0 = (engine.stats.steps, engine.stats.overlapped)
    lines: dict[str, Timeline] = {}
    pending = list(range(num_requests))
    t0 = time.perf_counter()

    def submit() -> None:
        i = pending.pop(0)
        rid = f"bench-{i}"
        lines[rid] = Timeline(time.perf_counter())
        engine.add_request(rid, prompts[i], params)

    for _ in range(min(concurrency, num_requests)):
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            lines[out.request_id].tokens.extend([now] * len(out.new_token_ids))
            if outputs is not None:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and pending:
                submit()
    wall = time.perf_counter() - t0
    result = BenchResult.from_timelines(
        lines.values(), num_requests, concurrency, input_len, output_len, wall
    )
    result.prompt_tokens = sum(len(p) for p in prompts)
    result.workload = workload
    result.steps = engine.stats.steps - steps0[0]
    result.overlapped_steps = engine.stats.overlapped - steps0[1]
    if spec is not None:
        result.spec_mode = engine.config.speculative
        result.spec_proposed = spec.proposed - spec0[0]
        result.spec_accepted = spec.accepted - spec0[1]
    return result


def warm_up(engine: Engine, concurrency: int, input_len: int, output_len: int, seed: int) -> None:
    """An untimed run at the shapes of the measured one: `concurrency` prompts of input_len
    tokens at once (other prompts: seed + 1), a few tokens out, so that kernels compile and
    buffers fill at the step sizes the timed run meets (a prompt step of 32 x 128 tokens, a
    prompt long enough to stream a CPU's weights) and not inside its first TTFT."""
    run_bench(engine, concurrency, concurrency, input_len, min(output_len, 4), seed=seed + 1)
