"""Scheduler: token budget, chunked prefill, decode priority, preemption, aborts, forks.

A simulated engine (sched_sim.py) drives it; random traffic is in test_scheduler_random.py.
"""

from __future__ import annotations

import random

import pytest

from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.request import Request, RequestStatus
from tests.support.sched_sim import EOS, VOCAB, Engine, next_token, params, reference


def test_chunked_prefill_never_starves_decodes() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32)
    eng = Engine(num_blocks=128, block_size=4, config=config)
    short = [Request(f"s{i}", [i + 1] * 5, params(30, ignore_eos=True)) for i in range(4)]
    for r in short:
        eng.sched.add(r)
    eng.step()  # the four short prompts in one step
    assert all(len(r.output_ids) == 1 for r in short)
    long = Request("long", list(range(1, 201)), params(3))
    eng.sched.add(long)
    chunks = []
    while not long.is_finished:
        decoding = [r for r in eng.sched.running if r.num_tokens - r.num_computed_tokens == 1]
        out, _ = eng.step()
        steps = {s.req.request_id: s for s in out.scheduled}
        for r in decoding:  # each running decode gets its token every step
            assert steps[r.request_id].num_new_tokens == 1 and steps[r.request_id].produces_token
        if "long" in steps and steps["long"].is_prefill_chunk:
            chunks.append(steps["long"])
    assert sum(c.num_new_tokens for c in chunks) == 200 and len(chunks) > 1
    assert all(c.num_new_tokens <= 32 - 4 for c in chunks)  # what the decodes leave
    assert [c.produces_token for c in chunks] == [False] * (len(chunks) - 1) + [True]
    eng.run()
    for r in short + [long]:
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, None)


def test_decodes_come_before_an_older_prompt() -> None:
    """Arrival order is not admission order (requests are stamped before they reach the
    scheduler): a prompt that arrived first must still leave the running decode its token."""
    eng = Engine(num_blocks=64, block_size=4, config=SchedulerConfig(2, 8))
    young = Request("young", [1, 2, 3], params(12, ignore_eos=True), arrival=2.0)
    eng.sched.add(young)
    eng.step()
    old = Request("old", list(range(1, 41)), params(2), arrival=1.0)
    eng.sched.add(old)
    while not old.is_finished:
        out, _ = eng.step()
        steps = {s.req.request_id: s.num_new_tokens for s in out.scheduled}
        assert steps["young"] == 1 and steps.get("old", 0) <= 7
    assert eng.sched.running == [young]  # the older request sorts first while both run
    eng.run()
    assert old.output_ids == reference(old.prompt_ids, [], 2, None)
    assert young.output_ids == reference(young.prompt_ids, [], 12, None)


def test_older_prefill_preempts_an_already_scheduled_decode() -> None:
    # 8 blocks of 4. young decodes; old (arrived first) prefills in chunks of 7 beside it until
    # its last chunk finds no block: young, newest, is preempted although its decode was already
    # in this step, which must drop it from the step and give its token back to the budget.
    eng = Engine(num_blocks=8, block_size=4, config=SchedulerConfig(2, 8))
    young = Request("young", [1, 2, 3, 4], params(20, ignore_eos=True), arrival=2.0)
    eng.sched.add(young)
    eng.step()
    old = Request("old", list(range(5, 31)), params(2), arrival=1.0)
    eng.sched.add(old)
    preempted = None
    while preempted is None:
        decoding = young.status is RequestStatus.RUNNING
        out, _ = eng.step()
        if out.preempted:
            preempted = out
    assert decoding and preempted.preempted == [young]
    assert [(s.req.request_id, s.num_new_tokens) for s in preempted.scheduled] == [("old", 5)]
    eng.run()
    assert old.output_ids == reference(old.prompt_ids, [], 2, None)
    assert young.output_ids == reference(young.prompt_ids, [], 20, None)
    assert young.num_cached_tokens == 0  # its first admission's count, not the recompute's


def test_long_prefill_token_threshold_caps_chunks() -> None:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=16
    )
    eng = Engine(num_blocks=64, block_size=4, config=config)
    a, b = Request("a", list(range(1, 41)), params(2)), Request("b", list(range(2, 42)), params(2))
    eng.sched.add(a)
    eng.sched.add(b)
    out, _ = eng.step()
    assert [(s.req.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 16), ("b", 16)]
    eng.run()


def test_steps_with_decodes_stay_within_the_largest_graph() -> None:
    """graph_rows (set by an engine with prompt CUDA graphs) caps the tokens of a step that runs
    decodes; a prompt alone still takes the whole budget, and outputs are unchanged."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    eng = Engine(num_blocks=64, block_size=4, config=config)
    eng.sched.graph_rows = 12
    first = Request("first", list(range(1, 41)), params(6, ignore_eos=True))
    eng.sched.add(first)
    out, _ = eng.step()
    assert [s.num_new_tokens for s in out.scheduled] == [40]  # no decodes: the full budget
    late = [Request(f"late{i}", [7 + i] * 9, params(3)) for i in range(2)]
    for r in late:
        eng.sched.add(r)
    out, _ = eng.step()
    assert [(s.req.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("first", 1), ("late0", 9), ("late1", 2)
    ]  # fmt: skip
    eng.run()
    for r in [first, *late]:
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, None)


def test_mixed_requests_under_a_small_budget() -> None:
    rng = random.Random(7)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24)
    eng = Engine(num_blocks=48, block_size=4, config=config)
    reqs = []
    for i in range(40):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 3, 9, 30, 70]))]
        reqs.append(Request(f"r{i}", prompt, params(rng.randint(1, 12)), eos_token_id=EOS))
        eng.sched.add(reqs[-1])
        if i % 3 == 0:
            eng.step()
    eng.run()
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, EOS)
        assert r.finish_reason == ("stop" if r.output_ids[-1] == EOS else "length")


def test_preempts_newest_and_resumes_with_same_tokens() -> None:
    # 6 blocks of 4: two requests of 8 + 12 tokens cannot both fit
    eng = Engine(num_blocks=6, block_size=4, config=SchedulerConfig(4, 64))
    old = Request("old", [5, 6, 7, 8, 9, 10], params(12, ignore_eos=True))
    new = Request("new", [11, 12, 13, 14, 15, 16], params(12, ignore_eos=True))
    eng.sched.add(old)
    eng.sched.add(new)
    preempted_at = None
    while preempted_at is None:
        out, _ = eng.step()
        if out.preempted:
            assert out.preempted == [new] and new.status is RequestStatus.PREEMPTED
            assert eng.sched.waiting[0] is new and new.block_table == []
            assert [s.req for s in out.scheduled] == [old]
            preempted_at = list(new.output_ids)
    assert preempted_at  # it had generated tokens, which it keeps
    eng.run()
    assert eng.sched.num_preemptions >= 1 and new.num_preemptions >= 1
    for r in (old, new):
        assert r.output_ids == reference(r.prompt_ids, [], 12, None)
    assert new.output_ids[: len(preempted_at)] == preempted_at


def test_abort_mid_prefill_frees_everything() -> None:
    eng = Engine(num_blocks=32, block_size=4, config=SchedulerConfig(2, 8))
    req = Request("a", list(range(1, 50)), params(4))
    eng.sched.add(req)
    out, _ = eng.step()
    assert out.scheduled[0].is_prefill_chunk and not out.scheduled[0].produces_token
    assert eng.bm.num_free_blocks < 32
    assert eng.sched.abort("a") and not eng.sched.abort("a")
    assert req.finish_reason == "abort" and req.block_table == []
    eng.bm.check()
    assert eng.bm.num_free_blocks == 32 and eng.sched.has_work()
    out, _ = eng.step()
    assert out.finished == [req] and out.is_empty and not eng.sched.has_work()


def test_abort_between_schedule_and_update() -> None:
    eng = Engine(num_blocks=32, block_size=4, config=SchedulerConfig(2, 64))
    a, b = Request("a", [1, 2, 3], params(4)), Request("b", [4, 5, 6], params(4))
    eng.sched.add(a)
    eng.sched.add(b)
    out = eng.sched.schedule()
    assert eng.sched.abort("a")
    finished = eng.sched.update(out, {"a": 9, "b": 9})  # a's sample arrives too late: ignored
    assert finished == [] and a.output_ids == [] and b.output_ids == [9]
    eng.bm.check()
    out = eng.sched.schedule()
    assert out.finished == [a] and [s.req for s in out.scheduled] == [b]
    with pytest.raises(ValueError, match="no sampled token"):
        eng.sched.update(out, {})


def test_outputs_alone_equal_outputs_in_a_crowd() -> None:
    rng = random.Random(3)
    system = [rng.randrange(1, VOCAB) for _ in range(12)]
    specs = []
    for i in range(33):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        prompt = (system if i % 2 else []) + tail  # half share a system prompt
        specs.append((f"r{i}", prompt, rng.randint(1, 16)))
    alone = {}
    for rid, prompt, max_tokens in specs:
        eng = Engine(num_blocks=64, block_size=4, config=SchedulerConfig(4, 16))
        req = Request(rid, prompt, params(max_tokens), eos_token_id=EOS)
        eng.sched.add(req)
        eng.run()
        alone[rid] = req.output_ids
        assert req.output_ids == reference(prompt, [], max_tokens, EOS)
    # 14 blocks of 4 tokens for 33 requests of up to 48 tokens: preemption is certain
    eng = Engine(num_blocks=14, block_size=4, config=SchedulerConfig(8, 24))
    crowd = [Request(rid, p, params(m), eos_token_id=EOS) for rid, p, m in specs]
    for req in crowd:
        eng.sched.add(req)
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert {r.request_id: r.output_ids for r in crowd} == alone
    assert any(r.num_cached_tokens > 0 for r in crowd)  # the system prompt was shared


def test_fork_shares_the_prompt() -> None:
    eng = Engine(num_blocks=32, block_size=4, config=SchedulerConfig(4, 64))
    parent = Request("p", list(range(1, 11)), params(6, ignore_eos=True))
    eng.sched.add(parent)
    eng.step()  # the prompt is computed once and the first token sampled
    first = parent.output_ids[0]
    children = []
    for i, token in enumerate([(first + 1) % VOCAB, (first + 2) % VOCAB]):
        child = Request(f"c{i}", parent.prompt_ids, params(6, ignore_eos=True))
        child.output_ids.append(token)  # another sample from the same logits
        eng.sched.fork("p", child)
        children.append(child)
    assert all(c.block_table == parent.block_table for c in children)
    out, _ = eng.step()
    assert len(out.copies) == 2  # two of the three writers copy the shared partial block
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    eng.run()
    for r in [parent] + children:
        assert r.output_ids == reference(r.prompt_ids, r.output_ids[:1], 6, None)
    with pytest.raises(ValueError, match="no unfinished"):
        eng.sched.fork("p", Request("c9", [1]))


def test_finish_reasons() -> None:
    eng = Engine(num_blocks=32, block_size=4, config=SchedulerConfig(4, 64, max_model_len=12))
    prompt = [3, 1, 4, 1, 5]
    first = next_token(prompt)
    stop = Request("stop", prompt, params(5, stop_token_ids={first}))
    eos = Request("eos", prompt, params(5), eos_token_id=first)
    ignored = Request("ignored", prompt, params(3, ignore_eos=True), eos_token_id=first)
    model_len = Request("ctx", prompt, params(20, ignore_eos=True))
    for r in (stop, eos, ignored, model_len):
        eng.sched.add(r)
    eng.run()
    assert stop.output_ids == [first] and stop.finish_reason == "stop"
    assert eos.output_ids == [first] and eos.finish_reason == "stop"
    assert len(ignored.output_ids) == 3 and ignored.finish_reason == "length"
    assert model_len.num_tokens == 12 and model_len.finish_reason == "length"
    assert stop.is_finished and not Request("x", [1]).is_finished


def test_add_refuses_what_can_never_fit() -> None:
    eng = Engine(num_blocks=4, block_size=4, config=SchedulerConfig(2, 16, max_model_len=64))
    with pytest.raises(ValueError, match=r"10 prompt tokens \+ max_tokens 7 need 17 .* holds 16"):
        eng.sched.add(Request("big", list(range(10)), params(7)))
    eng.sched.add(Request("ok", list(range(10)), params(6)))
    with pytest.raises(ValueError, match="already in use"):
        eng.sched.add(Request("ok", [1], params(1)))
    with pytest.raises(ValueError, match="max_model_len"):
        eng.sched.add(Request("long", list(range(64)), params(1)))
    with pytest.raises(ValueError, match="max_tokens"):
        Request("zero", [1], params(0))
    with pytest.raises(ValueError, match="no tokens"):
        Request("empty", [])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="every running decode"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="long_prefill"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    assert EngineConfig().scheduler == SchedulerConfig()


# -- property: random add / step / abort / fork over small pools ------------------------------
