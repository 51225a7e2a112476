"""The burst TTFT: C prompts arriving together, pipelined through the micro-batch groups."""

from __future__ import annotations

import pytest

from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.planner.burst import burst_first_tokens
from hetero.planner.placement import place_split
from hetero.planner.plan import PlanConfig
from tests.planner.test_planner import gpu, llama8b  # noqa: F401 (a fixture)


def test_second_group_runs_on_stage_one_while_the_first_is_on_stage_two():
    # 2 stages, 2 groups of 2 prompts, one step each, 1 s a step on every stage
    firsts = burst_first_tokens(2, 2, 4, 100, 1000, lambda *_: 1.0)
    assert firsts == [2.0, 2.0, 3.0, 3.0]  # group 1 waits for stage 1 only, not for group 0


def test_a_group_sends_its_next_chunk_after_the_last_came_back():
    # one group: its 3 chunks each cross both stages before the next starts
    firsts = burst_first_tokens(2, 1, 3, 100, 100, lambda i, n, c, r: 1.0 + i)
    assert firsts == [3.0, 6.0, 9.0]


@pytest.mark.parametrize("budget", [1, 37, 100, 150, 299, 4096])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_every_prompt_gets_one_first_token_and_chunks_cover_the_prompts(budget, groups):
    seen = []

    def chunk(i, n, cached, rows):
        if i == 0:
            seen.append((n, cached, rows))
            assert 1 <= n <= budget and rows >= 1 and (cached == 0 or rows == 1)
        return n / 1000

    firsts = burst_first_tokens(2, groups, 7, 100, budget, chunk)
    assert len(firsts) == 7 and firsts == sorted(firsts)
    assert sum(n for n, _, _ in seen) == 7 * 100


def test_plan_burst_of_one_is_the_single_prompt_ttft_and_two_cards_pipeline_it(llama8b):  # noqa: F811
    devs = [gpu("cuda:0", 2000, 32), gpu("cuda:1", 1000, 24)]
    ranges = [(0, 20), (20, 32)]
    one = place_split(llama8b, devs, PlanConfig(concurrency=1, context=1024), ranges)
    assert one.ttft_burst_s == pytest.approx(one.ttft_s)
    sched = SchedulerConfig(max_num_batched_tokens=2048)
    cfg = PlanConfig(
        concurrency=16, context=1024, prompt_len=512, engine=EngineConfig(scheduler=sched)
    )
    p = place_split(llama8b, devs, cfg, ranges)
    assert p.microbatches == 2
    # each group's 8 prompts are 2 chunks; the groups' chunks overlap on the two stages, so the
    # mean first token comes before the whole burst has crossed each stage in turn
    sequential = sum(s.prefill_s for s in p.stages) * 16
    assert p.ttft_burst_s < sequential
    assert p.ttft_burst_s > sum(s.prefill_s for s in p.stages)  # later than one prompt alone


def test_shares_of_one_gpu_contend_during_a_pipelined_burst(llama8b):  # noqa: F811
    from hetero.planner.shares import derive_share, parse_share

    base = gpu("cuda:0", 2000, 80)
    shares = [derive_share(base, parse_share(s)) for s in ("cuda:0@70%:40GB", "cuda:0@30%:30GB")]
    cards = [shares[0].replace(id="cuda:0"), shares[1].replace(id="cuda:1")]  # same speeds
    ranges = [(0, 20), (20, 32)]
    cfg = PlanConfig(concurrency=16, context=1024, prompt_len=256)
    on_shares = place_split(llama8b, shares, cfg, ranges)
    on_cards = place_split(llama8b, cards, cfg, ranges)
    assert on_shares.ttft_s == pytest.approx(on_cards.ttft_s)  # one prompt: the stages alternate
    assert on_shares.ttft_burst_s > 1.1 * on_cards.ttft_burst_s


def test_measured_shares_contend_by_their_measured_bandwidth_fractions(llama8b):  # noqa: F811
    from hetero.planner.shares import derive_share, parse_share, with_bw_fraction

    base = gpu("cuda:0", 2000, 80)
    ids = ("cuda:0@70%:40GB", "cuda:0@30%:30GB")
    derived = [derive_share(base, parse_share(s)) for s in ids]
    # as if measured: each reads 40% of the card's quantized-kernel rate alone
    slow = [
        d.replace(matmul={k: r.scaled(0.4, d.sm_share) for k, r in base.matmul.items()})
        for d in derived
    ]
    measured = [with_bw_fraction(s, [base]) for s in slow]
    assert [m.bw_fraction for m in measured] == pytest.approx([0.4, 0.4])
    assert with_bw_fraction(slow[0], []) is slow[0]  # its GPU not profiled: the law stays
    cards = [measured[0].replace(id="cuda:0"), measured[1].replace(id="cuda:1")]
    cfg, ranges = PlanConfig(concurrency=16, context=1024), [(0, 16), (16, 32)]
    # 0.4 + 0.4 of the card: the shares do not saturate it together, so no slowdown
    assert place_split(llama8b, measured, cfg, ranges).aggregate_tok_s == pytest.approx(
        place_split(llama8b, cards, cfg, ranges).aggregate_tok_s
    )
    # by the sqrt law (0.84 + 0.55) the same shares would contend
    law = [m.replace(bw_fraction=0.0) for m in measured]
    assert (
        place_split(llama8b, law, cfg, ranges).aggregate_tok_s
        < 0.9 * place_split(llama8b, cards, cfg, ranges).aggregate_tok_s
    )
