"""The split search: contiguous layer ranges over devices in pipeline order.

With k non-empty stages and C sequences, the pipeline runs n = min(C, k) micro-batches of
m = ceil(C / n) sequences. One cycle (every sequence gains a token) takes

    cycle = max(R, n * max_s t_s(m)),   R = sum_s t_s(m)  (t_s includes the hand-off to s + 1)

so one stream's latency is the sum of the stage times and a full pipeline's throughput is bound
by its slowest stage. For each k the search runs two exact dynamic programs over
(device, first free layer, stages left): one minimizing the slowest stage, one the sum; the
cycle of each result is then computed exactly and the best kept. At C = 1 (cycle = sum) and
C >= k (cycle = k * max) one of the two programs is exactly the objective.

`fits(i, a, b)` says whether device i can hold layers [a, b) (weights, KV, activations);
`stage_s(i, a, b, m)` is its decode step time. Ties go to the earlier split (and to using an
earlier device over skipping it), so plans are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

INF = math.inf


@dataclass(frozen=True)
class Split:
    ranges: tuple[tuple[int, int], ...]  # per device: [start, end), empty when start == end
    micro: int  # micro-batches in flight
    m: int  # sequences per micro-batch
    cycle_s: float  # seconds for every sequence to gain one token


Value = tuple[float, float]  # (primary, secondary): (max, sum) or (sum, max) of stage times


def _solve(
    n_dev: int,
    n_layers: int,
    k: int,
    cost: Callable[[int, int, int], float],
    combine: Callable[[Value, float], Value],
) -> tuple[Value, tuple[tuple[int, int], ...]] | None:
    """Best (value, ranges) with exactly k non-empty stages; None when nothing fits. Values
    compare as tuples, so among splits with the same slowest stage the one with the smallest
    sum (the lowest single-stream latency) wins, and the other way round."""

    @cache
    def best(i: int, a: int, left: int):
        if a == n_layers:
            return ((0.0, 0.0), ((a, a),) * (n_dev - i)) if left == 0 else None
        if i == n_dev or left == 0 or n_dev - i < left:
            return None
        found = None
        for b in range(a + 1, n_layers + 1):
            t = cost(i, a, b)
            if t == INF:
                continue
            rest = best(i + 1, b, left - 1)
            if rest is None:
                continue
            value = combine(rest[0], t)
            if found is None or value < found[0]:
                found = (value, ((a, b), *rest[1]))
        skip = best(i + 1, a, left)  # device i holds nothing: only when strictly better, so
        if skip is not None and (found is None or skip[0] < found[0]):  # equal cards fill in order
            found = (skip[0], ((a, a), *skip[1]))
        return found

    return best(0, 0, k)


def _by_max(v: Value, t: float) -> Value:
    return (max(v[0], t), v[1] + t)


def _by_sum(v: Value, t: float) -> Value:
    return (v[0] + t, max(v[1], t))


def search(
    n_dev: int,
    n_layers: int,
    concurrency: int,
    fits: Callable[[int, int, int], bool],
    stage_s: Callable[[int, int, int, int], float],
    use_all: bool = False,
    max_micro: int | None = None,
) -> Split | None:
    """The split with the shortest cycle at `concurrency`, or None when no split fits
    (`use_all`: only splits that give every device a layer; `max_micro`: at most that many
    micro-batches in flight, 1 where the stages run one after the other in one process)."""
    best_split: Split | None = None
    for k in range(n_dev if use_all else 1, n_dev + 1):
        micro = min(concurrency, k, max_micro or k)
        m = -(-concurrency // micro)

        def cost(i: int, a: int, b: int, m: int = m) -> float:
            return stage_s(i, a, b, m) if fits(i, a, b) else INF

        for combine in (_by_max, _by_sum):
            found = _solve(n_dev, n_layers, k, cost, combine)
            if found is None:
                continue
            times = [stage_s(i, a, b, m) for i, (a, b) in enumerate(found[1]) if b > a]
            cycle = max(sum(times), micro * max(times))
            if best_split is None or cycle < best_split.cycle_s * (1 - 1e-9):
                best_split = Split(found[1], micro, m, cycle)
    return best_split
