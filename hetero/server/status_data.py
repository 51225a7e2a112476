"""What the status page shows, as one JSON object (GET /status), and the plan it draws.

    model     name, file, context, layers
    plan      the stages as loaded (engine/executor.py's StageLayout: device, layers, weights
              mode, kernels, memory for weights and KV)
    live      tok/s, requests running and waiting, KV use per tier (the device's pool, RAM,
              disk), prefix-cache hit rate, speculative acceptance, each stage's busy share
    requests  the last requests, with their log fields (access_log.py), newest first

Rates (tok/s, busy shares) are over the time since an earlier call at least WINDOW_S ago (the
page asks every second), from counters: tokens handed to streams (server), seconds each stage
ran steps (engine).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from hetero.planner.drawing import plan_svg
from hetero.server.access_log import AccessLog

WINDOW_S = 3.0  # rates span at least this much time when the samples allow
KEEP_S = 30.0  # samples older than this are dropped


def hetero_version() -> str:
    try:
        return version("hetero")
    except PackageNotFoundError:
        return "unknown"


class StatusData:
    def __init__(self, state, access: AccessLog) -> None:
        self.state, self.access = state, access
        self.started = time.time()
        self.samples: deque[tuple[float, int, tuple[float, ...]]] = deque()

    async def snapshot(self) -> dict[str, Any]:
        state = self.state
        gauges = await state.engine_gauges()
        info = state.engine
        out: dict[str, Any] = {
            "status": state.status,
            "error": state.error,
            "version": hetero_version(),
            "uptime_s": round(time.time() - self.started, 3),
            "model": self._model(info),
            "plan": {"stages": [dataclasses.asdict(s) for s in (info.stages if info else ())]},
            "live": self._live(gauges),
            "requests": list(self.access.recent),
        }
        return out

    def plan_svg(self) -> str:
        info = self.state.engine
        stages = info.stages if info else ()
        n_layers = max((s.layer_end for s in stages), default=1)
        title = f"{self.state.served_name}: the model as loaded"
        return plan_svg(stages, n_layers, title, [_kv_note(info)] if info else [])

    def _model(self, info) -> dict[str, Any]:
        s = self.state.settings
        return {
            "name": self.state.served_name,
            "aliases": list(s.aliases),
            "path": str(s.model_path),
            "context": info.max_model_len if info else None,
            "n_layers": max((x.layer_end for x in info.stages), default=0) if info else None,
        }

    def _live(self, g) -> dict[str, Any]:
        m = self.state.metrics
        busy = g.stage_busy_s if g is not None else ()
        tok_s, shares = self._rates(time.monotonic(), m.streamed_tokens, busy)
        stages = self.state.engine.stages if self.state.engine else ()
        live: dict[str, Any] = {
            "tok_s": tok_s,
            "tokens_streamed": m.streamed_tokens,
            "requests_in_flight": m.in_flight,
            "prefix_hit_rate": m.prefix_hits / m.prefix_queries if m.prefix_queries else 0.0,
            "stages": [
                {"device": s.device, "busy": shares[i] if i < len(shares) else None}
                for i, s in enumerate(stages)
            ],
        }
        if g is not None:
            live.update(_engine_live(g))
        return live

    def _rates(
        self, now: float, tokens: int, busy: tuple[float, ...]
    ) -> tuple[float, list[float | None]]:
        """tok/s and each stage's busy share since the newest sample at least WINDOW_S old
        (else the oldest one kept); zeros on the first call."""
        samples = self.samples
        while samples and now - samples[0][0] > KEEP_S:
            samples.popleft()
        base = next((s for s in reversed(samples) if now - s[0] >= WINDOW_S), None)
        base = base or (samples[0] if samples else None)
        samples.append((now, tokens, busy))
        if base is None or now <= base[0]:
            return 0.0, [None] * len(busy)
        dt = now - base[0]
        shares: list[float | None] = [
            min(1.0, (b - (base[2][i] if i < len(base[2]) else 0.0)) / dt)
            for i, b in enumerate(busy)
        ]
        return (tokens - base[1]) / dt, shares


def _engine_live(g) -> dict[str, Any]:
    kv = [{"tier": g.pool_tier, "used": g.blocks_total - g.blocks_free, "total": g.blocks_total,
           "cached": g.blocks_cached}]  # fmt: skip
    t = g.tiers
    if t is not None:
        kv.append({"tier": "ram", "used": t.ram_blocks, "total": t.ram_slots})
        if t.disk_blocks is not None:
            kv.append({"tier": "disk", "used": t.disk_blocks, "total": t.disk_slots})
    return {
        "requests_running": g.running,
        "requests_waiting": g.waiting,
        "preemptions": g.preemptions,
        "kv": kv,
        "spec_proposed": g.spec_proposed,
        "spec_accepted": g.spec_accepted,
        "spec_acceptance": g.spec_accepted / g.spec_proposed if g.spec_proposed else None,
        "engine_steps": g.steps,
        "engine_busy_s": g.busy_s,
    }


def _kv_note(info) -> str:
    blocks = f"{info.num_blocks} blocks of {info.block_size} tokens"
    return f"KV pool: {blocks}; context {info.max_model_len} tokens"
