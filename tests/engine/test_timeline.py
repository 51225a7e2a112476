"""The engine reports where each request's time went, as data on its last output.

On the real model: a prompt cut into chunks shows each chunk as a prefill step of that many
tokens, the decode steps after it, and the sums agree with the steps; a request queued behind
another waits about that one's whole run; the steps kept are bounded; speculation's guesses are
counted per request and add up to the engine's own counters; the executor's layout names the
device, the layers and the bytes of the pool. On a synthetic model with a RAM tier, a prefix
copied back before the request runs shows as restore time.
"""

from __future__ import annotations

import math
import random

import pytest

from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.execution.kv_pool import block_bytes
from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    return load_model(smollm2_path)


def engine(loaded, trace_steps=64, speculative="off", **sched):
    cfg = EngineConfig(
        num_kv_blocks=96,
        speculative=speculative,
        trace_steps=trace_steps,
        scheduler=SchedulerConfig(**sched),
    )
    return build_engine(None, LaunchConfig(cfg), loaded=loaded)


def run_all(eng) -> dict:
    """Step until idle; each request's last output by id."""
    last = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                last[o.request_id] = o
    return last


def test_chunks_and_decode_steps_add_up(loaded):
    eng = engine(loaded, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = list(range(200, 350))  # 150 tokens: chunks of 64, 64, 22
    eng.add_request("a", prompt, GREEDY)
    tl = run_all(eng)["a"].timeline
    kinds = [s.kind for s in tl.steps]
    assert kinds == ["prefill"] * 3 + ["decode"] * 5  # the last chunk samples the first token
    assert [s.tokens for s in tl.steps] == [64, 64, 22, 1, 1, 1, 1, 1]
    assert tl.prefill_chunks == 3 and tl.decode_steps == 5 and tl.steps_dropped == 0
    assert tl.prefill_s == pytest.approx(sum(s.seconds for s in tl.steps[:3]))
    assert tl.decode_s == pytest.approx(sum(s.seconds for s in tl.steps[3:]))
    starts = [s.start_s for s in tl.steps]
    assert starts == sorted(starts) and starts[0] == pytest.approx(tl.queue_s + tl.restore_s)
    for s in tl.steps:  # one device, measured inside the step
        ((device, seconds),) = s.stages
        assert device == "cpu" and 0 < seconds <= s.seconds
        assert s.batch == 1
    assert tl.spec_proposed == tl.spec_accepted == tl.preemptions == 0


def test_queue_time_is_the_wait_behind_another_request(loaded):
    eng = engine(loaded, max_num_seqs=1)
    eng.add_request("first", list(range(300, 340)), GREEDY)
    eng.add_request("second", list(range(400, 440)), GREEDY)
    last = run_all(eng)
    first, second = last["first"].timeline, last["second"].timeline
    ran = first.prefill_s + first.decode_s
    assert first.queue_s < 0.05 * ran
    assert second.queue_s >= 0.9 * ran  # admitted only when the one seat was free again
    assert second.steps[0].step > first.steps[-1].step


def test_kept_steps_are_bounded(loaded):
    eng = engine(loaded, trace_steps=3)
    eng.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=8))
    tl = run_all(eng)["a"].timeline
    assert len(tl.steps) == 3 and tl.steps_dropped == 8 - 3
    assert tl.decode_steps == 7 and tl.prefill_chunks == 1
    eng = engine(loaded, trace_steps=0)
    eng.add_request("b", list(range(10, 30)), GREEDY)
    tl = run_all(eng)["b"].timeline
    assert tl.steps == [] and tl.steps_dropped == 0 and tl.decode_steps == 5  # sums still kept


def test_speculation_is_counted_per_request(loaded):
    eng = engine(loaded, speculative="ngram")
    tok = eng.tokenizer
    text = "one two three four five six seven eight nine ten. " * 6
    params = SamplingParams(temperature=0, max_tokens=24)
    for i in range(2):
        eng.add_request(f"r{i}", tok.encode(text + "one two" * i), params)
    last = run_all(eng)
    proposed = sum(o.timeline.spec_proposed for o in last.values())
    accepted = sum(o.timeline.spec_accepted for o in last.values())
    g = eng.gauges()
    assert proposed > 0 and (proposed, accepted) == (g.spec_proposed, g.spec_accepted)
    for o in last.values():
        tl = o.timeline
        verify = [s for s in tl.steps if s.kind == "verify"]
        assert verify and all(s.tokens > 1 for s in verify)
        assert 0 <= tl.spec_accepted <= tl.spec_proposed


def test_layout_of_the_loaded_model(loaded):
    eng = engine(loaded)
    (stage,) = eng.executor.info.stages
    cfg = loaded[1].config
    assert (stage.device, stage.layer_start, stage.layer_end) == ("cpu", 0, cfg.n_layers)
    assert stage.weights == eng.executor.info.weights
    assert stage.num_kv_blocks == eng.block_manager.num_blocks == 96
    per_block = block_bytes(cfg, cfg.n_layers, eng.config.block_size, stage.kv_dtype)
    assert stage.kv_bytes == 96 * per_block
    file_bytes = sum(t.nbytes for t in loaded[0].tensors.values())
    assert 0.5 * file_bytes < stage.weight_bytes < 4 * file_bytes
    assert set(stage.kernels) == {"qlinear", "paged_attention", "kv_write"}
    assert eng.gauges().stage_busy_s == ()  # no step yet
    eng.add_request("a", [1, 2, 3], GREEDY)
    tl = run_all(eng)["a"].timeline
    (busy,) = eng.gauges().stage_busy_s
    assert busy == pytest.approx(sum(s.stages[0][1] for s in tl.steps))


def test_a_prefix_restored_from_ram_is_restore_time(tmp_path):
    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", seed=0, progress=False)
    llm = LLM(str(path), num_kv_blocks=16, block_size=8, kv_ram_gb=0.01, trace_steps=8)
    rng = random.Random(0)
    ids = [1] + [rng.randrange(10, 4000) for _ in range(89)]
    eng = llm.engine
    eng.add_request("cold", ids, GREEDY)
    cold = run_all(eng)["cold"].timeline
    assert eng.kv_tiers.offload_all(eng.block_manager) == math.floor((90 + 5) / 8)
    eng.add_request("warm", ids, GREEDY)
    out = run_all(eng)["warm"]
    warm, stats = out.timeline, eng.kv_tiers.tiers.stats
    assert out.num_cached_tokens == 88 and stats.restores == 1
    # admitted while its blocks are copied back, computed only once they are in place (the
    # cold run is admitted and scheduled in one step)
    assert cold.restore_s < warm.restore_s
    assert warm.restore_s >= 0.5 * stats.restore_s > 0
    assert warm.steps[0].tokens == 2  # only what the restored blocks do not hold
