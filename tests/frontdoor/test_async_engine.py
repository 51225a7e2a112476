"""The engine thread and its asyncio callers, on a tiny synthetic model: streams equal the offline
engine's tokens, callers on two event loops are served at once, and one engine step wakes each
loop once, however many of its sequences the step advanced."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hetero.engine.config import EngineConfig
from hetero.factory import LaunchConfig
from hetero.frontdoor.thread import AsyncEngine
from hetero.launch import build_engine
from hetero.llm import LLM
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

PROMPTS = [[5 + i, 40 + 3 * i, 77, 9 + i] for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("ae") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )


def offline(path) -> list[list[int]]:
    """Each prompt's tokens from the offline engine."""
    return [
        o.outputs[0].token_ids for o in LLM(str(path), num_kv_blocks=64).generate(PROMPTS, PARAMS)
    ]


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the engine thread's wake-ups."""

    wakeups = 0

    def call_soon_threadsafe(self, *args, **kw):
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kw)


async def collect(ae: AsyncEngine, ids: range) -> dict[int, list[int]]:
    async def one(i: int) -> list[int]:
        out: list[int] = []
        async for step in ae.generate(f"r{i}", PROMPTS[i], PARAMS):
            out += step.new_token_ids
        return out

    results = await asyncio.gather(*(one(i) for i in ids))
    return dict(zip(ids, results))


def test_streams_match_offline_and_each_step_wakes_a_loop_once(model_path):
    want = offline(model_path)
    ae = AsyncEngine(
        build_engine(str(model_path), LaunchConfig(EngineConfig(num_kv_blocks=64)))
    ).start()
    got: dict[int, list[int]] = {}
    loops = [CountingLoop(), CountingLoop()]

    def serve(loop: CountingLoop, ids: range) -> None:
        got.update(loop.run_until_complete(collect(ae, ids)))
        loop.close()

    threads = [
        threading.Thread(target=serve, args=(loops[0], range(0, 3))),
        threading.Thread(target=serve, args=(loops[1], range(3, 6))),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        steps = ae.engine.stats.steps
    finally:
        ae.shutdown()
    assert [got[i] for i in range(len(PROMPTS))] == want
    # 3 sequences x 12 tokens per loop: one wake-up per output would be >= 36. Besides the
    # steps, each request's admission wakes its loop once (its future is settled).
    for loop in loops:
        assert 0 < loop.wakeups <= steps + 3 < 36


def test_a_caller_that_falls_behind_gets_the_waiting_steps_merged(model_path):
    want = offline(model_path)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    ae = AsyncEngine(
        build_engine(str(model_path), LaunchConfig(EngineConfig(num_kv_blocks=64)))
    ).start()

    async def slow_reader() -> list:
        outs = []
        async for out in ae.generate("slow", PROMPTS[0], params):
            outs.append(out)
            if len(outs) == 1:
                time.sleep(1.0)  # the loop is busy: the engine runs on and the steps pile up
        return outs

    try:
        outs = asyncio.run(slow_reader())
    finally:
        ae.shutdown()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == want
    assert len(outs) < len(want)  # fewer, larger outputs
    assert [lp.token_id for o in outs for lp in o.logprobs] == tokens
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
