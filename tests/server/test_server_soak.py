"""A short soak (benchmarks/soak.py runs the long one): clients send every kind of request in
turn against the real daemon, some leave mid-stream or give up; every finished answer must be
complete, every refusal must name its cause, and at the end no KV block is in use."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from hetero.server.soak import MemoryTrace, blocks_in_use, run_soak, settle
from hetero.server.soak_requests import MIX, OVER_LIMITS, Planner
from hetero.synth import write_synthetic
from tests.support.server_fixture import start_daemon

MAX_BYTES = 64 * 1024
SECONDS = 15.0
KINDS = [k for k in MIX if k != "over_limit"] + [f"over_{w}" for w in OVER_LIMITS]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("soak") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )


async def soak(url: str, pids: dict[str, int]):
    planner = Planner(random.Random(3), MAX_BYTES, 2048, fim=True, cut_streams=0.5,
                      abandon=0.2, order=KINDS)  # fmt: skip
    trace = MemoryTrace(pids, every_s=1.0)
    stop = asyncio.Event()
    sampler = asyncio.create_task(trace.run(stop))
    tally = await run_soak(url, 8, SECONDS, planner)
    gauges = await settle(url)
    stop.set()
    await sampler
    return tally, gauges, trace


def test_a_short_soak_answers_completely_and_leaks_nothing(model):
    d = start_daemon(str(model), "--threads", "1", "--num-kv-blocks", "160", "--max-request-bytes",
                     str(MAX_BYTES), "--max-num-seqs", "16")  # fmt: skip
    try:
        engine = int(re.findall(r"engine process started \(pid (\d+)\)", d.log())[-1])
        tally, gauges, trace = asyncio.run(soak(d.url, {"server": d.proc.pid, "engine": engine}))
        m = d.metrics()
    finally:
        assert d.finish() == 0, d.log()
    assert not tally.problems, tally.problems
    assert sum(tally.sent.values()) >= len(KINDS)  # every kind went at least once
    for kind in ("chat", "logprobs", "json", "n2", "long", "fim"):
        assert tally.done[kind] + tally.abandoned > 0 and tally.done[kind] >= 1, tally.summary()
    assert tally.done["chat_stream"] >= 1 and tally.cut >= 1, tally.summary()
    assert {f"over_{w}" for w in OVER_LIMITS} <= set(tally.refused), tally.summary()
    assert tally.statuses[413] >= 1 and tally.statuses[400] >= len(OVER_LIMITS) - 1
    assert blocks_in_use(gauges) == 0 and gauges["hetero_num_requests_running"] == 0
    assert m["hetero_num_requests_waiting"] == 0 and m["hetero_requests_in_flight"] == 0
    assert m['hetero_http_requests_total{endpoint="/v1/chat/completions",code="499"}'] >= 1
    flat = trace.flatness("engine", 0.0)
    assert flat["samples"] >= SECONDS / 2 and flat["min_mib"] > 0
