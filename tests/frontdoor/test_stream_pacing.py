"""async_engine.paced: one sequence's outputs from its queue, merged and paced.

The queue is filled the way the engines fill it (one StepOutput per step, from a timer standing
in for the engine's steps), and read the way the server reads it.
"""

from __future__ import annotations

import asyncio

import pytest

from hetero.engine.output import StepOutput
from hetero.frontdoor.thread import OutputQueue, paced

Feed = list[tuple[float, list[int], bool]]  # (seconds before the output, its tokens, finished)


def _steps(n: int, every: float) -> Feed:
    """n outputs of one token each (0, 1, ...), `every` seconds apart, the last finished."""
    return [(every, [i], i == n - 1) for i in range(n)]


async def _feed(sink: OutputQueue, feed: Feed, rid: str = "r") -> None:
    for delay, tokens, fin in feed:
        await asyncio.sleep(delay)
        sink.put_nowait(
            StepOutput(rid, tokens, finished=fin, finish_reason="length" if fin else None)
        )


def _read(feed: Feed, pace) -> list[tuple[float, list[int], bool]]:
    """`feed` put into an OutputQueue and read through paced(): (seconds of each output since
    the start, its tokens, finished)."""

    async def main():
        loop, aborted, sink = asyncio.get_running_loop(), [], OutputQueue()
        t0 = loop.time()
        feeder = asyncio.create_task(_feed(sink, feed))
        got = [
            (loop.time() - t0, out.new_token_ids, out.finished)
            async for out in paced(sink, pace, lambda: aborted.append(True))
        ]
        await feeder
        assert not aborted  # it ended by itself
        return got

    return asyncio.run(main())


def test_without_pace_every_step_is_its_own_output() -> None:
    got = _read(_steps(6, 0.01), None)
    assert [ids for _, ids, _ in got] == [[i] for i in range(6)]
    assert [f for _, _, f in got] == [False] * 5 + [True]


def test_paced_outputs_carry_every_token_in_order_and_keep_the_interval() -> None:
    pace = 0.06
    got = _read(_steps(20, 0.01), lambda: pace)
    tokens = [t for _, ids, _ in got for t in ids]
    assert tokens == list(range(20))  # none lost, none repeated
    assert got[0][1] == [0]  # the first never waits
    assert len(got) < 20 and any(len(ids) > 1 for _, ids, _ in got)
    assert got[-1][2] and not any(f for _, _, f in got[:-1])
    gaps = [b[0] - a[0] for a, b in zip(got, got[1:])]
    assert min(gaps[:-1]) >= pace * 0.9, gaps  # the last comes at once (the test below)


def test_pace_is_asked_after_every_output() -> None:
    """A pace that turns on midway (auto: more streams arrived) takes effect at once."""
    calls = []

    def pace() -> float:
        calls.append(1)
        return 0.0 if len(calls) < 4 else 0.05

    got = _read(_steps(15, 0.01), pace)
    assert [len(ids) for _, ids, _ in got[:4]] == [1, 1, 1, 1]
    assert len(got) < 15 and [t for _, ids, _ in got for t in ids] == list(range(15))


def test_a_refusal_in_the_queue_is_raised_and_not_aborted() -> None:
    async def run() -> list[bool]:
        sink = OutputQueue()
        aborted: list[bool] = []
        sink.put_nowait(ValueError("prompt too long"))
        with pytest.raises(ValueError, match="too long"):
            async for _ in paced(sink, None, lambda: aborted.append(True)):
                pass
        return aborted

    assert asyncio.run(run()) == []


def test_a_reader_that_stops_early_aborts_its_sequence() -> None:
    async def run() -> list[bool]:
        sink = OutputQueue()
        aborted: list[bool] = []
        feeder = asyncio.create_task(_feed(sink, _steps(10, 0.01)))
        stream = paced(sink, lambda: 0.02, lambda: aborted.append(True))
        async for _ in stream:
            break
        await stream.aclose()
        feeder.cancel()
        return aborted

    assert asyncio.run(run()) == [True]


def test_a_paced_stream_ends_without_waiting_out_its_interval():
    """The last output of a paced stream comes when the engine has it, not at the end of the
    interval it falls in: a client's answer ends (and its next request can start) at once. The
    outputs inside an interval still come merged, at its end while the stream goes on."""
    got = _read([(0, [1], False), (0.05, [2], False), (0.05, [3], True)], lambda: 0.6)
    assert [(tokens, fin) for _, tokens, fin in got] == [([1], False), ([2, 3], True)]
    assert got[0][0] < 0.04 and 0.09 < got[1][0] < 0.3
    # token 4 (the end) comes 0.8 s in: tokens 2 and 3 wait for the interval (0.6 s), not for it
    feed = [(0, [1], False), (0.05, [2], False), (0.05, [3], False), (0.7, [4], True)]
    got = _read(feed, lambda: 0.6)
    assert [tokens for _, tokens, _ in got] == [[1], [2, 3], [4]]
    assert 0.55 <= got[1][0] < 0.75 and 0.75 < got[2][0] < 1.1
