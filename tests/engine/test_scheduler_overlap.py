"""Overlapped steps in the scheduler (Scheduler.advance, then update): the next step is
scheduled before the step before has its tokens, which stand as placeholders -1 - i meanwhile.

The simulated engine (sched_sim.OverlapEngine) runs each step with the placeholders read from
the step before's samples, as the device does, and checks every KV read against the request's
tokens; outputs must equal the simulated model run alone (under random traffic:
test_scheduler_random.py).
"""

from __future__ import annotations

import pytest

from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request, RequestStatus
from tests.support.sched_sim import EOS, Engine, OverlapEngine, next_token, params, reference


def test_placeholders_stand_for_the_tokens_until_update() -> None:
    eng = OverlapEngine(num_blocks=32, block_size=4, config=SchedulerConfig(4, 64))
    a = Request("a", [3, 4, 5], params(6, ignore_eos=True))
    b = Request("b", [6, 7], params(6, ignore_eos=True))
    for r in (a, b):
        eng.sched.add(r)
    eng.step()  # both prompts run; their tokens are not applied yet
    assert a.output_ids == b.output_ids == [] and eng.pending is not None
    eng.sched.advance(eng.pending[0])
    assert (a.output_ids, b.output_ids) == ([-1], [-2])  # rows 0 and 1 of the step's samples
    assert (a.num_computed_tokens, b.num_computed_tokens) == (3, 2)
    out = eng.sched.schedule()  # the next step decodes the placeholders
    assert [(s.req.request_id, s.start_pos, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 3, 1),
        ("b", 2, 1),
    ]
    first, _, rows = eng.pending
    assert eng.sched.update(first, {"a": rows[0], "b": rows[1]}) == []
    assert a.output_ids == [next_token([3, 4, 5])] and b.output_ids == [next_token([6, 7])]


def test_a_request_at_its_max_tokens_is_not_scheduled_past_them() -> None:
    eng = OverlapEngine(num_blocks=32, block_size=4, config=SchedulerConfig(4, 64))
    r = Request("r", [1, 2, 3], params(2, ignore_eos=True))
    eng.sched.add(r)
    steps = []
    while eng.has_work():
        out, _ = eng.step()
        steps.append([s.num_new_tokens for s in out.scheduled])
    # the prompt, then one decode: its placeholder is the second and last token, so no third
    assert steps == [[3], [1], []] and eng.wasted == 0
    assert r.finish_reason == "length"
    assert r.output_ids == reference([1, 2, 3], [], 2, None)


def test_a_stop_wastes_one_row_of_the_next_step_and_nothing_else() -> None:
    prompt = [5, 9, 2]
    want = reference(prompt, [], 40, None)
    stop = want[4]
    k = want.index(stop)  # the first time the stop token comes
    eng = OverlapEngine(num_blocks=64, block_size=4, config=SchedulerConfig(4, 64))
    r = Request("r", prompt, params(40, stop_token_ids=[stop]))
    eng.sched.add(r)
    eng.run()
    assert r.output_ids == want[: k + 1] and r.finish_reason == "stop"
    assert eng.wasted == 1  # the decode after the stop ran before the stop was seen
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_a_request_preempted_with_a_placeholder_keeps_its_token() -> None:
    """Scheduling the next step can preempt a request advanced past the step before: it goes
    back to the queue with its placeholder, which update() then fills there."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16)
    eng = OverlapEngine(num_blocks=5, block_size=2, config=config)
    old = Request("old", [1, 2, 3], params(5, ignore_eos=True), arrival=1.0)
    new = Request("new", [4, 5, 6], params(5, ignore_eos=True), arrival=2.0)
    for r in (old, new):
        eng.sched.add(r)
    preempted = []
    while eng.has_work():
        out, _ = eng.step()
        preempted += out.preempted
        if out.preempted:  # preempted after advance: its placeholder's token is filled now
            assert all(v.output_ids and v.output_ids[-1] >= 0 for v in out.preempted)
    assert new in preempted
    assert old.output_ids == reference([1, 2, 3], [], 5, None)
    assert new.output_ids == reference([4, 5, 6], [], 5, None)


def test_an_abort_while_a_step_is_in_flight() -> None:
    eng = OverlapEngine(num_blocks=32, block_size=4, config=SchedulerConfig(4, 64))
    a = Request("a", [1, 2], params(8, ignore_eos=True))
    b = Request("b", [3, 4], params(8, ignore_eos=True))
    for r in (a, b):
        eng.sched.add(r)
    eng.step()
    eng.step()
    assert eng.sched.abort("a")  # its second token's step has run, unsettled
    eng.run()
    assert a.status is RequestStatus.FINISHED_ABORTED and len(a.output_ids) == 1
    assert b.output_ids == reference([3, 4], [], 8, None)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


@pytest.mark.parametrize("num_blocks", [24, 200])
def test_an_overlapped_run_computes_what_a_plain_one_does(num_blocks) -> None:
    """The same requests through plain and overlapped steps: the same outputs; with a pool
    that never preempts, the same tokens computed but one row for each request that stopped
    short of its max_tokens (the step after its stop ran before the stop was seen)."""

    def requests():
        return [
            Request(f"r{i}", [i + 1] * (i % 5 + 1) + [7, i], params(12 + i), eos_token_id=EOS)
            for i in range(12)
        ]

    runs = []
    for cls in (Engine, OverlapEngine):
        eng = cls(num_blocks=num_blocks, block_size=4, config=SchedulerConfig(6, 16))
        reqs = requests()
        for r in reqs:
            eng.sched.add(r)
        computed = 0
        while eng.has_work():
            out, _ = eng.step()
            computed += out.num_batched_tokens
        runs.append((eng, reqs, computed))
    (_, plain, n_plain), (eng, overlapped, n_over) = runs
    for p, o in zip(plain, overlapped, strict=True):
        assert o.output_ids == p.output_ids == reference(p.prompt_ids, [], p.max_tokens, EOS)
    short = sum(r.finish_reason == "stop" and len(r.output_ids) < r.max_tokens for r in plain)
    assert short > 0
    if num_blocks == 24:
        assert eng.sched.num_preemptions > 0
    else:
        assert eng.sched.num_preemptions == 0
        assert eng.wasted == short and n_over == n_plain + short
