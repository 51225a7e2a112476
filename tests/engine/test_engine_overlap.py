"""Overlapped engine steps (engine/overlap.py) on real models: the next step is submitted before
this one's tokens are on the host, its rows reading them where the sampler left them.

On a CPU nothing runs to hide the host's work behind, but every piece runs as on a GPU
(`overlap_schedule="on"`): the placeholders, their resolution in the eager step and in the
graphs' static buffers, the samples settled a step late. Greedy outputs are checked against the
model run alone (test_engine.check_outputs: a difference only at a near-tie), sampled ones
against the plain engine's (seeded rows draw the same noise whatever their batch).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.execution.cuda_graph import DecodeGraphs
from hetero.kernels.registry import forcing
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from tests.engine.test_engine import check_outputs, prompts_mixed
from tests.support import exact_weights

GREEDY = SamplingParams(temperature=0, max_tokens=10)
REFS = {"kv_write": "torch", "paged_attention": "torch", "paged_attention_sinks": "torch"}


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    return load_model(smollm2_path, exact_weights.runtime())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("ov") / "t.gguf", "tiny-llama", "q8_0", False)
    return load_model(path, RuntimeConfig(device="cpu", weights="fp16", dtype="fp32"))


def llm_of(loaded, overlap: str, **options) -> LLM:
    options = {"num_kv_blocks": 512, "kv_dtype": "fp32", "speculative": "off", **options}
    return LLM(loaded=loaded, overlap_schedule=overlap, **options)


def test_overlapped_greedy_batch_matches_the_model(loaded):
    """Mixed prompts in chunks of 64 tokens a step, prefix hits and a pool that preempts."""
    llm = llm_of(loaded, "on", num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=16)
    assert llm.engine.overlap
    prompts = prompts_mixed(llm.tokenizer, n=16)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    check_outputs(loaded, prompts, outs, GREEDY.max_tokens, llm.tokenizer.eos_ids)
    bm = llm.engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks


def test_overlapped_sampling_equals_plain_sampling(loaded):
    """Seeded rows with penalties, a logit bias, min_tokens, logprobs and a stop token: the
    tokens, logprobs and finish reasons of plain steps; a stopped request costs one row."""
    prompts = ["Tell me a story", "The river", "def f(x):", "1, 2, 3,"]
    base = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=14, logprobs=2)
    params = [
        replace(base, seed=11),
        replace(base, seed=12, presence_penalty=0.5, frequency_penalty=0.3),
        replace(base, seed=13, repetition_penalty=1.3, min_tokens=6),
        replace(base, seed=14, logit_bias={100: 3.0}),
    ]
    plain = llm_of(loaded, "off")
    want = plain.generate(prompts, params)
    # stop the last request at a token it produced mid-way (not its max_tokens-th)
    stop = want[3].outputs[0].token_ids[5]
    params[3] = replace(params[3], stop_token_ids=[stop])
    want[3] = plain.generate(prompts[3:], params[3:])[0]
    over = llm_of(loaded, "on")
    before = over.engine.stats.tokens
    got = over.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got[3].outputs[0].finish_reason == "stop"
    assert len(got[3].outputs[0].token_ids) < params[3].max_tokens
    assert over.engine.overlap and not plain.engine.overlap
    # the only extra work: the stopped request's row of the step after its stop
    computed = over.engine.stats.tokens - before
    one_by_one = sum(
        len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in want
    )  # every prompt token and every output token but the last is computed once
    assert computed == one_by_one + 1


def test_overlapped_steps_through_the_graphs_buffers(tiny):
    """The decode graphs' static-buffer path (on a CPU, as the graphs replay it): each step's
    placeholders resolved in the tokens buffer after the host's fill."""
    prompts = [[5 + i for i in range(n)] for n in (5, 17, 30, 9, 2)]
    params = [replace(GREEDY, max_tokens=n, ignore_eos=True) for n in (4, 12, 8, 10, 16)]
    with forcing(REFS):
        llm = llm_of(tiny, "on", num_kv_blocks=48, block_size=16, max_model_len=128,
                     max_num_seqs=5, enforce_eager=True, device="cpu",
                     max_num_batched_tokens=12)  # fmt: skip
        ex = llm.engine.executor
        ex.set_graphs(DecodeGraphs(tiny[1], ex.pool, 8, 128, 32, 4))
        outs = llm.generate(prompts, params)
    graphs = ex.runner.graphs
    assert graphs.steps > 10 and graphs.prompt_steps > 0
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        check_outputs(tiny, [prompt], [out], p.max_tokens, ())


def test_an_abort_while_a_step_is_in_flight(loaded):
    llm = llm_of(loaded, "on", max_num_seqs=4)
    eng = llm.engine
    ids = llm.tokenizer.encode("Once upon a time")
    eng.add_request("a", ids, replace(GREEDY, max_tokens=20, ignore_eos=True))
    eng.add_request("b", ids + [11], replace(GREEDY, max_tokens=6, ignore_eos=True))
    got = {"a": [], "b": []}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng._inflight, "a step is in flight between two calls"
    assert eng.abort("a")
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert len(got["a"]) == 2  # settled before the abort: the first two steps' tokens
    alone = llm_of(loaded, "off").generate([ids + [11]], replace(GREEDY, max_tokens=6))
    assert got["b"] == alone[0].outputs[0].token_ids
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_where_steps_overlap(loaded):
    assert not llm_of(loaded, "auto").engine.overlap  # auto: a GPU's logits only
    assert not llm_of(loaded, "off").engine.overlap
    assert llm_of(loaded, "on", speculative="ngram").engine.overlap  # between guesses
    with pytest.raises(ValueError, match="overlap_schedule must be one of"):
        EngineConfig(overlap_schedule="sometimes", speculative="off")


def test_bench_counts_the_overlapped_steps(tmp_path):
    """`hetero bench` says how many of its steps overlapped: all but the first with overlap
    on (each step is settled in the call that submits the next), none with it off."""
    import re

    from click.testing import CliRunner

    from hetero.cli import main

    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", False)
    base = ["bench", str(path), "--input-len", "16", "--output-len", "8", "--num-kv-blocks",
            "64", "-c", "2", "--speculative", "off", "--no-warmup"]  # fmt: skip
    counts = {}
    for mode in ("on", "off"):
        res = CliRunner().invoke(main, [*base, "--overlap-schedule", mode])
        assert res.exit_code == 0, res.output
        m = re.search(r"engine steps (\d+), (\d+) overlapped", res.output)
        assert m, res.output
        counts[mode] = int(m[1]), int(m[2])
    assert counts["off"][1] == 0 and counts["off"][0] >= 8
    steps, overlapped = counts["on"]
    assert steps == counts["off"][0] and overlapped == steps


@pytest.mark.gpu
def test_gpu_overlapped_steps_equal_plain_steps(tmp_path):
    """On a GPU, captured graphs: the samples' pinned copies and events, the placeholders
    resolved in the graph's buffer by device ops. With every request running to its
    max_tokens, both runs have the same steps, so the same numbers."""
    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", False)
    loaded = load_model(path, RuntimeConfig(device="cuda"))
    prompts = [[5 + i for i in range(n)] for n in (5, 17, 30, 9, 2)]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True, logprobs=1)
        for i, n in enumerate((4, 12, 8, 10, 16))
    ]
    runs = {}
    for mode in ("off", "on"):
        llm = LLM(loaded=loaded, overlap_schedule=mode, speculative="off", num_kv_blocks=64,
                  max_model_len=128, max_num_seqs=5)  # fmt: skip
        assert llm.engine.overlap == (mode == "on")
        runs[mode] = (llm.generate(prompts, params), llm.engine.executor.runner.graphs)
    (plain, _), (over, graphs) = runs["off"], runs["on"]
    assert graphs is not None and graphs.steps > 10
    for a, b in zip(plain, over, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
