"""The scheduler over a model with a sliding-window KV cache group (sched_sim.py checks every
group's reads each step): long generations keep the window group's blocks bounded, admission
counts both groups' blocks, and preemption under a short pool recomputes each request to the
simulated model's own output."""

from __future__ import annotations

import pytest

from hetero.engine.config import SchedulerConfig
from hetero.engine.request import Request
from tests.support.sched_sim import EOS, Engine, params, reference

B = 4


def run(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[Request]:
    reqs = [
        Request(f"r{i}", p, params(max_tokens), eos_token_id=EOS) for i, p in enumerate(prompts)
    ]
    for r in reqs:
        eng.sched.add(r)
    eng.run()
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, [], r.max_tokens, EOS)
    return reqs


@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_long_generation_holds_a_bounded_window(window: int) -> None:
    eng = Engine(200, B, SchedulerConfig(2, 8), windows=(0, window))
    run(eng, [[3] * 9, [5, 6, 7]], max_tokens=120)  # 15x and more the longest window
    # the window before the step's block boundary, and the step of at most 8 tokens
    bound = -(-(window - 1) // B) + (B + 8 - 2) // B + 1
    assert 0 < eng.peak_window_blocks <= bound
    assert eng.sched.num_preemptions == 0


def test_preemption_recomputes_window_models_exactly() -> None:
    eng = Engine(24, B, SchedulerConfig(4, 12), windows=(0, 6))
    run(eng, [[i + 1] * (5 + i) for i in range(4)], max_tokens=40)
    assert eng.sched.num_preemptions > 0


def test_a_request_that_cannot_fit_is_refused_by_its_groups_need() -> None:
    eng = Engine(20, B, SchedulerConfig(1, 4), windows=(0, 6))
    # 64 tokens: 16 full blocks + 4 window blocks (steps of 4 from 4k + 3) = 20: admitted
    eng.sched.add(Request("ok", [1] * 8, params(56), eos_token_id=EOS))
    with pytest.raises(ValueError, match="whole pool holds 64 tokens"):
        eng.sched.add(Request("no", [1] * 8, params(60), eos_token_id=EOS))  # 17 + 4 > 20
