"""Scheduler under random traffic (hypothesis): arrivals, aborts and forks over a small pool
never leak a block, never lose a request, and every finished request's output equals the
simulated model run alone on its own tokens; with a sliding-window KV cache group too (window 0:
none), whose reads through its own tables the simulator checks each step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request
from tests.support.sched_sim import EOS, VOCAB, Engine, OverlapEngine, params, reference

OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "step", "step", "abort", "fork", "fork"]),
        st.integers(0, 999),
    ),
    min_size=5,
    max_size=60,
)


SHAPES = dict(
    num_blocks=st.integers(4, 16),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    budget_extra=st.integers(0, 12),
    window=st.sampled_from([0, 0, 1, 3, 6]),
)


@settings(max_examples=120, deadline=None)
@given(**SHAPES, ops=OPS)
def test_random_traffic_never_leaks(
    num_blocks, block_size, max_num_seqs, budget_extra, window, ops
):
    run_traffic(Engine, num_blocks, block_size, max_num_seqs, budget_extra, window, ops)


@settings(max_examples=120, deadline=None)
@given(**SHAPES, ops=OPS.map(lambda ops: [op for op in ops if op[0] != "fork"]))
def test_random_overlapped_traffic_never_leaks(
    num_blocks, block_size, max_num_seqs, budget_extra, window, ops
):
    """The same through overlapped steps (sched_sim.OverlapEngine; the engine forks nothing
    while a step is in flight, so no forks)."""
    run_traffic(OverlapEngine, num_blocks, block_size, max_num_seqs, budget_extra, window, ops)


def run_traffic(cls, num_blocks, block_size, max_num_seqs, budget_extra, window, ops) -> None:
    config = SchedulerConfig(max_num_seqs, max_num_seqs + budget_extra)
    eng = cls(num_blocks, block_size, config, windows=(0, window) if window else (0,))
    capacity = eng.bm.max_tokens(eng.sched.step_tokens, num_blocks * block_size)
    prefix = [7, 7, 8, 8, 9, 9, 1, 2]
    reqs, expected_start, aborted = [], {}, set()
    for i, (op, x) in enumerate(ops):
        sched = eng.sched
        if op == "add":
            prompt = prefix[: x % 9] + [x % VOCAB + 1] * (x % 5 + 1)
            max_tokens = min(x % 13 + 1, capacity - len(prompt))
            if max_tokens < 1:
                continue
            reqs.append(Request(f"r{i}", prompt, params(max_tokens), eos_token_id=EOS))
            sched.add(reqs[-1])
            expected_start[reqs[-1].request_id] = []
        elif op == "step":
            eng.step()
        elif op == "abort" and reqs:
            victim = reqs[x % len(reqs)]
            if sched.abort(victim.request_id):
                aborted.add(victim.request_id)
        elif op == "fork" and sched.running:
            parent = sched.running[x % len(sched.running)]
            c = parent.num_computed_tokens
            child = Request(f"r{i}", parent.prompt_ids, params(parent.max_tokens), eos_token_id=EOS)
            child.output_ids = parent.tokens(parent.num_prompt_tokens, c) + [x % (VOCAB - 1) + 1]
            if c < parent.num_prompt_tokens:  # mid-prefill: the child is the prompt alone
                child.output_ids = []
            if len(child.output_ids) >= child.max_tokens:
                continue
            sched.fork(parent.request_id, child)
            reqs.append(child)
            expected_start[child.request_id] = list(child.output_ids)
        eng.bm.check()
        eng.check_scheduler()
    eng.run(max_steps=eng.steps + 2_000)
    for r in reqs:
        assert r.is_finished
        if r.request_id not in aborted:
            start = expected_start[r.request_id]
            assert r.output_ids == reference(r.prompt_ids, start, r.max_tokens, EOS)
