"""What the engine counts, and the snapshot of it that /metrics shows.

`EngineStats` is updated once per step. `EngineGauges` is a plain snapshot of the engine's
queues, KV pool and counters (`gauges(engine)`), taken where the engine runs (its thread or its
process) and sent to the server, which only formats it (server/metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineStats:
    """Counters the bench and the server's /metrics read.

    Decode-only steps are also counted apart, plain ones and verify ones (some request carried
    guesses; rows: tokens computed), so a benchmark can price a verify step against a plain one.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.busy_s = 0.0
        self.decode = [0, 0, 0.0]  # plain decode steps: steps, rows, seconds
        self.verify = [0, 0, 0.0]  # decode steps with guesses: steps, rows, seconds
        self.graphed = 0  # steps run through the CUDA graphs' static buffers (cuda_graph.py)
        self.overlapped = 0  # steps settled after the next was submitted (engine/overlap.py)
        self.stage_s: list[float] = []  # seconds each stage ran steps, where the executor says

    def record(self, out, seconds: float, graphed: bool = False, stages=()) -> None:
        """`stages`: the executor's (where, seconds or None) per stage of this step."""
        self.steps += 1
        for i, (_, s) in enumerate(stages):
            if s is not None:
                if i >= len(self.stage_s):
                    self.stage_s += [0.0] * (i + 1 - len(self.stage_s))
                self.stage_s[i] += s
        self.graphed += graphed
        self.tokens += out.num_batched_tokens
        self.busy_s += seconds
        sched = out.scheduled
        if all(s.produces_token and s.num_new_tokens == 1 + len(s.spec_ids) for s in sched):
            kind = self.verify if any(s.spec_ids for s in sched) else self.decode
            kind[0] += 1
            kind[1] += out.num_batched_tokens
            kind[2] += seconds


@dataclass(frozen=True)
class TierGauges:
    """The RAM and disk tiers of the KV cache (kv_tiers/): size, hits, moves, restore time."""

    ram_blocks: int
    ram_slots: int
    disk_blocks: int | None  # None: no disk tier
    disk_slots: int | None
    hits: dict[str, int]  # tier -> prefix-hit blocks served from it
    bytes_moved: dict[str, int]  # direction -> bytes
    blocks_moved: dict[str, int]  # direction -> blocks
    dropped: int
    restores: int
    restore_s: float


@dataclass(frozen=True)
class EngineGauges:
    waiting: int
    running: int
    preemptions: int
    pool_tier: str  # "gpu" | "cpu": where the KV pool is
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    steps: int
    tokens: int
    busy_s: float
    decode_steps: int
    decode_s: float
    graph_steps: int
    spec_proposed: int
    spec_accepted: int
    restarts: int = 0
    overlapped_steps: int = 0
    tiers: TierGauges | None = None
    stage_busy_s: tuple[float, ...] = ()  # per stage of the executor: seconds running steps


def gauges(engine) -> EngineGauges:
    """An Engine's queues, pool and counters now (the server's /metrics formats them)."""
    sched, bm, stats, spec = engine.scheduler, engine.block_manager, engine.stats, engine.spec
    tiers = engine.executor.kv_tiers
    return EngineGauges(
        waiting=sched.num_waiting,
        running=sched.num_running,
        preemptions=sched.num_preemptions,
        pool_tier="gpu" if engine.executor.info.device.startswith("cuda") else "cpu",
        blocks_total=bm.num_blocks,
        blocks_free=bm.num_free_blocks,
        blocks_cached=bm.num_cached_blocks,
        steps=stats.steps,
        tokens=stats.tokens,
        busy_s=stats.busy_s,
        decode_steps=stats.decode[0],
        decode_s=stats.decode[2],
        graph_steps=stats.graphed,
        spec_proposed=0 if spec is None else spec.proposed,
        spec_accepted=0 if spec is None else spec.accepted,
        restarts=engine.restarts,
        overlapped_steps=stats.overlapped,
        tiers=None if tiers is None else tiers.gauges(),
        stage_busy_s=tuple(stats.stage_s),
    )
