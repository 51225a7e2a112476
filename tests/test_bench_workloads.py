"""The benchmark's prompts: a code-edit prompt holds a real file and a rename task."""

from __future__ import annotations

import pytest

from hetero.bench_workloads import chat_prompts, code_edit_prompts, random_prompts


def test_code_edit_prompt_holds_a_file_cut_to_size(smollm2):
    prompts = code_edit_prompts(smollm2, 3, 200, seed=0)
    assert len({tuple(p) for p in prompts}) == 3  # three different files
    for ids in prompts:
        text = smollm2.decode(ids)
        assert "```python\n" in text and "_v2`" in text and "def " in text
        assert 200 <= len(ids) <= 200 + 120  # the file (~200 tokens) plus the task and template


def test_other_workloads(smollm2):
    chats = chat_prompts(smollm2, 4, seed=1)
    assert len({tuple(p) for p in chats}) == 4
    rand = random_prompts(1000 + 50, 2, 16, seed=0)
    assert all(len(p) == 16 and all(1000 <= t < 1050 for t in p) for p in rand)
    with pytest.raises(ValueError, match="workload"):
        from hetero.bench_workloads import make_prompts

        make_prompts(None, "nope", 1, 1, 0)


def test_per_stream_speed_when_steps_deliver_several_tokens():
    """Speculative steps deliver tokens together (intervals of 0): the per-stream speed spreads
    each step over its tokens instead of dividing by a zero median."""
    from hetero.bench import BenchResult

    def result(itl):
        return BenchResult(1, 1, 8, len(itl) + 1, 1.0, [0.1], itl, len(itl) + 1, 8)

    assert result([0.02, 0.02, 0.04]).per_stream_tok_s == pytest.approx(50.0)  # 1 / median
    assert result([0.0, 0.0, 0.06, 0.0, 0.06]).per_stream_tok_s == pytest.approx(5 / 0.12)
    assert result([]).per_stream_tok_s == 0.0


def test_the_warm_up_runs_the_measured_shapes(smollm2_path):
    """`hetero bench`'s untimed run: all `concurrency` prompts of the measured length in the
    first step (kernels compile at its size), a few tokens out, every request finished."""
    from hetero.bench import warm_up
    from hetero.engine.config import EngineConfig
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine
    from hetero.model.llama import load_model
    from tests.support import exact_weights

    loaded = load_model(smollm2_path, exact_weights.runtime())
    engine = build_engine(None, LaunchConfig(EngineConfig(num_kv_blocks=64)), loaded=loaded)
    sizes = []
    record = engine.stats.record

    def spy(out, *args, **kwargs):
        sizes.append(out.num_batched_tokens)
        record(out, *args, **kwargs)

    engine.stats.record = spy
    warm_up(engine, concurrency=3, input_len=40, output_len=100, seed=0)
    assert sizes[0] == 3 * 40  # the three prompts in one step
    assert sizes[1:] == [3, 3, 3]  # then 4 tokens out each: three decode steps of 3 rows
    assert not engine.has_unfinished()
