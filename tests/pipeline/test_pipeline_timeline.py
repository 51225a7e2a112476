"""A pipeline reports where its layers are and where each step's time went, per stage.

Two real stage processes on the CPU (gloo): the executor's layout names each stage's layers as
split, the weights each holds (together what one process holds: the same tensors, cut in two);
every step of a traced request lists both stages with the time each ran it, and the engine's
per-stage busy time is the sum of those.
"""

from __future__ import annotations

import pytest

from hetero.llm import LLM
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

OPTS = dict(kv_dtype="fp32", weights="dense", num_kv_blocks=32, stage_timeout=120.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "tiny-llama.gguf"
    return write_synthetic(path, "tiny-llama", "q8_0", progress=False)


def test_stages_layout_and_step_times(tiny):
    whole = LLM(str(tiny), **OPTS)
    (one,) = whole.engine.executor.info.stages
    n = one.layer_end
    llm = LLM(str(tiny), split=f"cpu=0-0,cpu=1-{n - 1}", trace_steps=16, **OPTS)
    try:
        eng = llm.engine
        a, b = eng.executor.info.stages
        assert (a.layer_start, a.layer_end, b.layer_start, b.layer_end) == (0, 1, 1, n)
        assert a.device == b.device == "cpu" and a.weights == b.weights == one.weights
        assert a.num_kv_blocks == b.num_kv_blocks == eng.block_manager.num_blocks
        # the embedding goes with the first stage, the norm and head with the last: the two
        # halves hold what one process holds
        assert a.weight_bytes + b.weight_bytes == pytest.approx(one.weight_bytes, rel=0.01)
        assert a.kv_bytes + b.kv_bytes == pytest.approx(one.kv_bytes, rel=0.01)
        eng.add_request("r", [1, 5, 9, 13, 200, 301], SamplingParams(temperature=0, max_tokens=6))
        last = None
        while eng.has_unfinished():
            for o in eng.step():
                last = o if o.finished else last
        tl = last.timeline
        assert [s.kind for s in tl.steps] == ["prefill"] + ["decode"] * 5
        for s in tl.steps:
            (d0, t0), (d1, t1) = s.stages
            assert d0 == d1 == "cpu" and t0 > 0 and t1 > 0
        busy = eng.gauges().stage_busy_s
        for i in range(2):
            assert busy[i] == pytest.approx(sum(s.stages[i][1] for s in tl.steps))
    finally:
        llm.engine.close()
