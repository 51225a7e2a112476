"""admit_wait_ms: new prompts wait a little while decodes run, to share one prefill step.

The simulated engine (sched_sim.py) steps the real scheduler; the clock is a value the test moves
(requests carry it as their arrival time), so waits are exact and nothing sleeps.
"""

from __future__ import annotations

import pytest

from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request
from tests.support.sched_sim import Engine, params, reference


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _engine(wait_ms: float, seats: int = 8):
    clock = Clock()
    config = SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=64, admit_wait_ms=wait_ms)
    return Engine(num_blocks=256, block_size=4, config=config, clock=clock), clock


def _request(rid: str, clock: Clock, n: int = 6, tokens: int = 20) -> Request:
    return Request(rid, list(range(1, n + 1)), params(tokens, ignore_eos=True), arrival=clock.now)


def _prefilled(out) -> set[str]:
    return {s.req.request_id for s in out.scheduled if s.is_prefill_chunk}


def test_arrivals_within_the_wait_share_one_prefill_step() -> None:
    eng, clock = _engine(10.0)
    first = _request("a", clock)
    eng.sched.add(first)
    out, _ = eng.step()  # nothing decodes yet: admitted at once
    assert _prefilled(out) == {"a"}
    clock.now += 0.001
    b = _request("b", clock)
    eng.sched.add(b)
    out, _ = eng.step()
    assert _prefilled(out) == set() and [s.req.request_id for s in out.scheduled] == ["a"]
    clock.now += 0.004
    c = _request("c", clock)
    eng.sched.add(c)
    out, _ = eng.step()
    assert _prefilled(out) == set()  # b has waited 4 ms of 10
    clock.now += 0.0061  # b: 10.1 ms
    out, _ = eng.step()
    assert _prefilled(out) == {"b", "c"}  # one step for both
    assert eng.sched.held_steps == 2
    eng.run()
    for r in (first, b, c):
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, None)


def test_no_wait_without_running_decodes_or_with_the_seats_filled() -> None:
    eng, clock = _engine(1000.0, seats=3)
    eng.sched.add(_request("a", clock))
    assert _prefilled(eng.step()[0]) == {"a"}  # idle engine: no reason to wait
    eng.sched.add(_request("b", clock))
    assert _prefilled(eng.step()[0]) == set()
    eng.sched.add(_request("c", clock))  # b and c take the 2 free seats: nothing to wait for
    assert _prefilled(eng.step()[0]) == {"b", "c"}


def test_a_preempted_request_never_waits() -> None:
    eng, clock = _engine(1000.0)
    a = _request("a", clock)
    eng.sched.add(a)
    eng.step()
    back = _request("back", clock)
    back.num_preemptions = 1  # as the scheduler leaves one it preempted
    eng.sched.add(back)
    assert _prefilled(eng.step()[0]) == {"back"}


def test_zero_admits_at_once_and_outputs_do_not_depend_on_the_wait() -> None:
    results = {}
    for wait in (0.0, 5.0):
        eng, clock = _engine(wait)
        reqs = []
        for i in range(5):
            r = _request(f"r{i}", clock, n=3 + i, tokens=12)
            reqs.append(r)
            eng.sched.add(r)
            out, _ = eng.step()
            if wait == 0.0:
                assert f"r{i}" in _prefilled(out)
            clock.now += 0.002
        eng.run()
        results[wait] = [r.output_ids for r in reqs]
        assert all(o == reference(r.prompt_ids, [], 12, None) for r, o in zip(reqs, results[wait]))
    assert results[0.0] == results[5.0]


def test_bad_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="admit_wait_ms"):
        SchedulerConfig(admit_wait_ms=-1)
