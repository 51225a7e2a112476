"""The server's metrics in Prometheus' text format (exposition format 0.0.4).

Counters and histograms are updated on the event loop's thread only (handlers), so they need no
lock. The engine's own gauges (queue, KV blocks, tiers, steps, speculation) are a snapshot the
engine takes where it runs when /metrics is scraped (Engine.gauges, an EngineGauges); this module
only formats them (`engine_lines`).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from hetero.engine.stats import EngineGauges, TierGauges

# Seconds. TTFT spans queueing and prefill (long on a CPU); ITL is one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    """Cumulative buckets (`le` = less than or equal), a sum and a count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, n in zip((*self.buckets, "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """What the handlers count; `render` adds the engine's gauges."""

    def __init__(self) -> None:
        self.http: Counter[tuple[str, int]] = Counter()  # (endpoint, status code)
        self.finished: Counter[str] = Counter()  # sequences by finish reason
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens of the sequences admitted
        self.prefix_hits = 0  # of them, tokens the prefix cache served
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.in_flight = 0  # generation requests being served
        self.engine_restarts = 0  # engines started again after one died
        self.streamed_tokens = 0  # tokens handed to streams as they came (the live tok/s)

    def sequence_started(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries += prompt_tokens
        self.prefix_hits += cached_tokens

    def render(self, engine: EngineGauges | None, status: str) -> str:
        """The whole page; `engine`: the engine's gauges (None: no engine yet)."""
        lines: list[str] = []
        add = _Writer(lines)
        add.gauge(
            "hetero_up",
            "1 when the model is loaded and requests are served",
            [("", int(status == "ready"))],
        )
        add.counter(
            "hetero_http_requests_total",
            "HTTP requests by endpoint and status code",
            [(f'endpoint="{e}",code="{c}"', n) for (e, c), n in sorted(self.http.items())],
        )
        add.counter(
            "hetero_request_finished_total",
            "sequences finished, by reason",
            [(f'finish_reason="{r}"', n) for r, n in sorted(self.finished.items())],
        )
        add.counter(
            "hetero_prompt_tokens_total",
            "prompt tokens of served requests",
            [("", self.prompt_tokens)],
        )
        add.counter(
            "hetero_generation_tokens_total", "tokens generated", [("", self.generation_tokens)]
        )
        add.gauge(
            "hetero_requests_in_flight",
            "HTTP generation requests being served",
            [("", self.in_flight)],
        )
        add.counter(
            "hetero_engine_process_restarts_total",
            "engines the daemon started again after one died",
            [("", self.engine_restarts)],
        )
        add.histogram("hetero_time_to_first_token_seconds", "time to first token", self.ttft)
        add.histogram("hetero_inter_token_latency_seconds", "time between tokens", self.itl)
        add.histogram("hetero_e2e_request_latency_seconds", "whole request latency", self.e2e)
        self._prefix_cache(add)
        if engine is not None:
            lines += engine_lines(engine)
        return "\n".join(lines) + "\n"

    def _prefix_cache(self, add: _Writer) -> None:
        add.counter(
            "hetero_prefix_cache_queries_total",
            "prompt tokens looked up",
            [("", self.prefix_queries)],
        )
        add.counter(
            "hetero_prefix_cache_hits_total",
            "prompt tokens served from the cache",
            [("", self.prefix_hits)],
        )
        rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        add.gauge("hetero_prefix_cache_hit_rate", "hits / queries since start", [("", rate)])


def engine_lines(g: EngineGauges) -> list[str]:
    """The engine's gauges and counters in the exposition format."""
    lines: list[str] = []
    add = _Writer(lines)
    add.gauge("hetero_num_requests_waiting", "sequences queued", [("", g.waiting)])
    add.gauge("hetero_num_requests_running", "sequences running", [("", g.running)])
    add.counter("hetero_num_preemptions_total", "preemptions", [("", g.preemptions)])
    # the pool on the model's device; the RAM/disk tiers add their own rows
    tier = f'tier="{g.pool_tier}"'
    total, used = g.blocks_total, g.blocks_total - g.blocks_free
    add.gauge("hetero_kv_blocks_total", "KV blocks in the pool", [(tier, total)])
    add.gauge("hetero_kv_blocks_used", "KV blocks held by requests", [(tier, used)])
    add.gauge(
        "hetero_kv_blocks_cached",
        "free KV blocks still holding a cached prefix",
        [(tier, g.blocks_cached)],
    )
    add.gauge("hetero_kv_cache_usage_ratio", "share of the pool held by requests",
              [(tier, used / total)])  # fmt: skip
    if g.tiers is not None:
        _tier_lines(add, g.tiers)
    add.counter("hetero_engine_steps_total", "engine steps", [("", g.steps)])
    add.counter("hetero_engine_tokens_total", "tokens computed by steps", [("", g.tokens)])
    add.counter("hetero_engine_busy_seconds_total", "time in steps", [("", g.busy_s)])
    # the other steps ran prompt tokens (prefill chunks, alone or beside decodes)
    add.counter("hetero_engine_decode_steps_total", "decode-only steps", [("", g.decode_steps)])
    add.counter(
        "hetero_engine_decode_seconds_total", "time in decode-only steps", [("", g.decode_s)]
    )
    add.counter(
        "hetero_engine_graph_steps_total", "steps replayed from CUDA graphs", [("", g.graph_steps)]
    )
    add.counter(
        "hetero_engine_overlapped_steps_total",
        "steps whose host work ran while the next step ran",
        [("", g.overlapped_steps)],
    )
    add.counter("hetero_engine_restarts_total", "executor restarts after a failure",
                [("", g.restarts)])  # fmt: skip
    _speculation(add, g.spec_proposed, g.spec_accepted)
    return lines


def _speculation(add: _Writer, proposed: int, accepted: int) -> None:
    """Speculative decoding's guesses (zeros when it is off)."""
    add.counter("hetero_spec_proposed_tokens_total", "tokens guessed", [("", proposed)])
    add.counter(
        "hetero_spec_accepted_tokens_total", "guessed tokens the model accepted", [("", accepted)]
    )
    rate = accepted / proposed if proposed else 0.0
    add.gauge("hetero_spec_acceptance_rate", "accepted / proposed since start", [("", rate)])


def _tier_lines(add: _Writer, t: TierGauges) -> None:
    """The RAM and disk tiers of the KV cache: size, hits, moves, restore time."""
    rows = [('tier="ram"', t.ram_blocks)]
    totals = [('tier="ram"', t.ram_slots)]
    if t.disk_blocks is not None:
        rows.append(('tier="disk"', t.disk_blocks))
        totals.append(('tier="disk"', t.disk_slots))
    add.gauge("hetero_kv_tier_blocks_total", "KV blocks a lower tier can hold", totals)
    add.gauge("hetero_kv_tier_blocks_cached", "KV blocks a lower tier holds", rows)
    add.counter(
        "hetero_kv_tier_hits_total",
        "prefix-hit blocks served, by the tier they were in",
        [(f'tier="{k}"', n) for k, n in sorted(t.hits.items())],
    )
    moves = sorted(t.bytes_moved.items())
    add.counter(
        "hetero_kv_tier_bytes_moved_total",
        "KV bytes copied between tiers",
        [(f'direction="{d}"', n) for d, n in moves],
    )
    add.counter(
        "hetero_kv_tier_blocks_moved_total",
        "KV blocks copied between tiers",
        [(f'direction="{d}"', t.blocks_moved[d]) for d, _ in moves],
    )
    add.counter(
        "hetero_kv_tier_dropped_blocks_total",
        "evicted KV blocks no lower tier could take",
        [("", t.dropped)],
    )
    add.counter("hetero_kv_restores_total", "prefix restores finished", [("", t.restores)])
    add.counter(
        "hetero_kv_restore_seconds_total", "time restores took, summed", [("", t.restore_s)]
    )


class _Writer:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def _family(self, name: str, kind: str, help: str) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]

    def _samples(self, name: str, samples: Iterable[tuple[str, float]]) -> None:
        self.lines += [
            f"{name}{{{labels}}} {value}" if labels else f"{name} {value}"
            for labels, value in samples
        ]

    def counter(self, name: str, help: str, samples: Iterable[tuple[str, float]]) -> None:
        self._family(name, "counter", help)
        self._samples(name, samples)

    def gauge(self, name: str, help: str, samples: Iterable[tuple[str, float]]) -> None:
        self._family(name, "gauge", help)
        self._samples(name, samples)

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        self._family(name, "histogram", help)
        self.lines += h.lines(name)


class SequenceClock:
    """Times one sequence for the histograms: first token from arrival, then each gap."""

    __slots__ = ("metrics", "arrival", "last", "first")

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.first: float | None = None  # when the first token came (perf_counter)

    def tokens(self, n: int) -> None:
        """n tokens arrived now (one per decode step, or several steps' at once when the caller
        fell behind: they share the gap). Every token but the first is one ITL observation."""
        if n <= 0:
            return
        now = time.perf_counter()
        self.metrics.streamed_tokens += n
        if self.last is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
            gaps, gap = n - 1, 0.0  # tokens that came with the first reached the client with it
        else:
            gaps, gap = n, (now - self.last) / n
        for _ in range(gaps):
            self.metrics.itl.observe(gap)
        self.last = now


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for tests and tools reading /metrics."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
