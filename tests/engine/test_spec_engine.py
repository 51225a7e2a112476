"""Speculative decoding in the real engine: the output is what plain decoding gives.

Greedy and seeded requests are compared token for token with the same engine built with
speculation off, alone and in batches (chunked prefill, prefix hits, preemption), on a random
llama-family model (`hetero synth`) and on SmolLM2. The KV cache is fp32 (the exact path); where
a greedy token differs it must be at a near-tie of the reference logits (batch shapes round fp32
matmuls differently in the last bits), as in test_engine.
"""

from __future__ import annotations

import pytest

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.engine import Engine
from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from tests.engine.test_engine import _divergence_gap
from tests.support import exact_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(
        tmp_path_factory.mktemp("spec") / "tiny.gguf", "tiny-llama", "q8_0", progress=False
    )
    return path, load_model(path, exact_weights.runtime())


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return smollm2_path, load_model(smollm2_path, exact_weights.runtime())


def engine(
    model, speculative: str, draft_model: str | None = None, overlap: str = "auto", **sched
) -> Engine:
    path, loaded = model
    sched.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(
        kv_dtype="fp32",
        num_kv_blocks=sched.pop("num_kv_blocks", 256),
        block_size=8,
        speculative=speculative,
        num_speculative_tokens=6,
        draft_model=draft_model,
        overlap_schedule=overlap,
        scheduler=SchedulerConfig(**sched),
    )
    return build_engine(str(path), LaunchConfig(cfg), loaded=loaded)


def run(eng: Engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    outs = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        eng.block_manager.check()
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    return [outs[f"r{i}"] for i in range(len(prompts))]


def assert_same_greedy(model, prompts, got, want) -> None:
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g != w:
            k = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            gap = _divergence_gap(model[1][1], prompt, w, k)
            assert gap < 1e-3, f"output differs at token {k} where the top-2 gap is {gap:.2e}"


def repetitive_prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts with repeated runs (what n-gram lookup feeds on), half sharing a prefix."""
    shared = [(7 * j + 3) % vocab for j in range(24)]
    out = []
    for i in range(n):
        run_ = [(11 * j + 5 * i + 1) % vocab for j in range(6 + i)]
        body = run_ * 3 + [i + 2]
        out.append(shared + body if i % 2 else body)
    return out


def test_random_model_greedy_batch_equals_plain(tiny):
    """8 requests, chunked prefill at 24 tokens/step, prefix hits, preemption (tiny pool)."""
    opts = dict(max_num_batched_tokens=24, num_kv_blocks=24)
    prompts = repetitive_prompts(8, 200)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = run(engine(tiny, "off", **opts), prompts, params)
    eng = engine(tiny, "ngram", **opts)
    got = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert eng.spec.proposed > 0 and eng.spec.accepted > 0
    assert_same_greedy(tiny, prompts, got, want)
    alone = [run(engine(tiny, "ngram"), [p], params)[0] for p in prompts[:2]]
    assert_same_greedy(tiny, prompts[:2], alone, want[:2])


def test_random_model_seeded_sampling_equals_plain(tiny):
    """The acceptance test draws each row as plain decoding would: same seed, same tokens."""
    prompts = repetitive_prompts(4, 200)
    params = [
        SamplingParams(temperature=t, top_k=k, seed=100 + i, max_tokens=30, ignore_eos=True)
        for i, (t, k) in enumerate([(0.05, 0), (0.1, 20), (1.0, 0), (0.2, 5)])
    ]
    params[3] = SamplingParams(
        temperature=0.5, seed=9, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=30
    )
    want = run(engine(tiny, "off"), prompts, params)
    eng = engine(tiny, "ngram")
    assert run(eng, prompts, params) == want
    assert eng.spec.accepted > 0


def test_ngram_between_overlapped_steps_equals_plain(tiny):
    """N-gram guesses with overlapped steps (engine/overlap.py): a step runs plain while a
    request has a guess and overlapped while none has; both kinds ran (chunked prefill, a pool
    that preempts), and greedy and seeded outputs are those of plain decoding."""
    opts = dict(max_num_batched_tokens=24, num_kv_blocks=24)
    prompts = repetitive_prompts(6, 200)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = run(engine(tiny, "off", overlap="off", **opts), prompts, greedy)
    eng = engine(tiny, "ngram", overlap="on", **opts)
    got = run(eng, prompts, greedy)
    assert eng.overlap and eng.spec.accepted > 0
    assert eng.stats.verify[0] > 0 and eng.stats.overlapped > 0
    assert_same_greedy(tiny, prompts, got, want)
    seeded = [
        SamplingParams(temperature=0.05, seed=40 + i, max_tokens=30, ignore_eos=i % 2 == 0)
        for i in range(4)
    ]
    want = run(engine(tiny, "off", overlap="off"), prompts[:4], seeded)
    eng = engine(tiny, "ngram", overlap="on")
    assert run(eng, prompts[:4], seeded) == want
    assert eng.stats.verify[0] > 0 and eng.stats.overlapped > 0


def test_an_abort_as_overlapped_steps_turn_plain(tiny):
    """Guesses found after an overlapped step: the step still in flight is settled first, and
    a request aborted since its submission has its row dropped there (the plain path's
    sampling would have looked up its parameters, gone with it)."""
    eng = engine(tiny, "ngram", overlap="on")
    prompts = repetitive_prompts(3, 200)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    for _ in range(200):
        eng.step()
        if eng._guessing and eng._inflight:
            break
    else:
        pytest.fail("no step found guesses with a step in flight")
    assert eng.abort("r1")
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.verify[0] > 0 and eng.stats.overlapped > 0
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_draft_model_runs_plain_steps(tiny, drafts):
    eng = engine(tiny, "draft", str(drafts[0]), overlap="auto")
    assert not eng.overlap  # (auto, and a CPU besides)
    with pytest.raises(ValueError, match="speculative 'draft'"):
        EngineConfig(speculative="draft", draft_model=str(drafts[0]), overlap_schedule="on")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafts")
    # same seed (so the same vocabulary), coarser weights: a draft that is sometimes wrong
    same = write_synthetic(folder / "coarse.gguf", "tiny-llama", "q4_0", progress=False)
    other = write_synthetic(folder / "qwen.gguf", "tiny-qwen2", "q8_0", progress=False)
    return same, other


def test_draft_model_greedy_equals_plain_and_sampling_runs(tiny, drafts):
    """A draft with other weights (so some guesses fail) under a small pool (preemption)."""
    opts = dict(max_num_batched_tokens=24, num_kv_blocks=24)
    prompts = repetitive_prompts(6, 200)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = run(engine(tiny, "off", **opts), prompts, params)
    eng = engine(tiny, "draft", str(drafts[0]), **opts)
    got = run(eng, prompts, params)
    assert eng.spec.proposed > 0 and eng.spec.accepted < eng.spec.proposed
    assert_same_greedy(tiny, prompts, got, want)
    assert all(not m.block_table for m in eng.spec.mirrors.values())
    eng.spec.bm.check()
    assert eng.spec.bm.num_free_blocks == eng.spec.bm.num_blocks, "a draft block leaked"
    hot = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    out = run(eng, prompts[:3], hot)
    assert all(len(o) == 20 for o in out)
    own = engine(tiny, "draft", str(tiny[0]))  # the target as its own draft: all accepted
    run(own, prompts[:2], params)
    assert own.spec.accepted == own.spec.proposed > 0


def test_draft_with_another_vocabulary_is_refused(tiny, drafts):
    with pytest.raises(ValueError, match="vocabulary"):
        engine(tiny, "draft", str(drafts[1]))
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative="draft")


def test_smollm2_copy_greedy_equals_plain_with_logprobs_and_stops(smol):
    path, loaded = smol
    src = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    tasks = ["Repeat this code exactly:\n", "Rename add to plus in this code:\n"]
    llms = {
        s: LLM(
            str(path),
            loaded=loaded,
            kv_dtype="fp32",
            num_kv_blocks=128,
            speculative=s,
            num_speculative_tokens=6,
        )
        for s in ("off", "ngram")
    }
    tok = llms["off"].tokenizer

    def prompt(task: str) -> list[int]:
        msgs = [{"role": "user", "content": task + src}]
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))

    prompts = [prompt(t) for t in tasks]
    params = [
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=["sub"]),
    ]
    want = llms["off"].generate(prompts, params)
    got = llms["ngram"].generate(prompts, params)
    spec = llms["ngram"].engine.spec
    assert spec.accepted > 0, "copying code must accept guesses"
    assert_same_greedy(
        smol, prompts, [o.outputs[0].token_ids for o in got], [o.outputs[0].token_ids for o in want]
    )
    for g, w in zip(got, want, strict=True):
        if g.outputs[0].token_ids == w.outputs[0].token_ids:
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    lg, lw = got[0].outputs[0].logprobs, want[0].outputs[0].logprobs
    assert len(lg) == len(got[0].outputs[0].token_ids)
    for a, b in zip(lg, lw):
        if a.token_id != b.token_id:
            break
        assert abs(a.logprob - b.logprob) < 1e-3
    assert got[1].outputs[0].finish_reason == "stop"
    assert "sub" not in got[1].outputs[0].text


def test_auto_guesses_on_the_cpu_only_while_few_requests_decode(tiny):
    """The default, "auto": n-gram guesses on a CPU, but none while more requests decode than
    SPEC_AUTO_MAX_DECODES (a full batch keeps the device busy; guess rows would cost compute)."""
    from hetero.engine.spec import SPEC_AUTO_MAX_DECODES

    assert EngineConfig().speculative == "auto"
    eng = engine(tiny, "auto")
    assert eng.spec is not None and eng.spec.max_decodes == SPEC_AUTO_MAX_DECODES
    prompt = list(range(5, 25)) * 3
    params = SamplingParams(temperature=0, max_tokens=32)
    eng.add_request("alone", prompt, params)
    while not eng.scheduler.decoding():
        eng.step()
    assert eng._guesses() is not None, "one decoding request is asked for guesses"
    for i in range(SPEC_AUTO_MAX_DECODES):
        eng.add_request(f"r{i}", prompt, params)
    while len(eng.scheduler.decoding()) <= SPEC_AUTO_MAX_DECODES:
        eng.step()
    assert eng._guesses() is None


def test_auto_guesses_on_cuda_where_guesses_pay_for_the_verify_step():
    """On CUDA "auto" is ngram too (verify steps replay the decode graphs), with the off-switch
    priced for the GPU's costlier verify step by weights mode; "off" is off everywhere."""
    from hetero.engine.executor import ExecutorInfo
    from hetero.engine.spec import SPEC_AUTO_MAX_DECODES, SPEC_CUDA_VERIFY_COST, make_speculator

    def spec(mode: str, device: str, weights: str = "auto"):
        resolved = RuntimeConfig(device, weights=weights).weights_mode()
        info = ExecutorInfo(num_blocks=16, device=device, weights=resolved, kv_dtype="fp16")
        return make_speculator(EngineConfig(speculative=mode), info, {})

    gpu, cpu = spec("auto", "cuda:0", "quant"), spec("auto", "cpu")
    assert gpu.max_decodes == cpu.max_decodes == SPEC_AUTO_MAX_DECODES
    assert gpu.adapt.min_gain == pytest.approx(SPEC_CUDA_VERIFY_COST["quant"] - 1)
    assert gpu.adapt.k_min == gpu.adapt.k_max and cpu.adapt.k_min == 1
    assert spec("auto", "cuda", "dense").adapt.min_gain == pytest.approx(
        SPEC_CUDA_VERIFY_COST["dense"] - 1
    )
    assert cpu.adapt.min_gain == 0
    assert spec("ngram", "cuda").max_decodes is None
    assert spec("off", "cuda") is None and spec("off", "cpu") is None


def test_bench_spec_ab_prints_one_line_per_workload_and_concurrency(tiny):
    """`hetero bench --spec-ab`: both sides run on one loaded engine, each pair one line with
    the speeds, the speedup, the acceptance and the step times; without speculation it says so."""
    import re

    from click.testing import CliRunner

    from hetero.cli import main

    base = ["bench", str(tiny[0]), "--input-len", "24", "--output-len", "12", "--num-kv-blocks",
            "64", "--spec-ab", "-c", "1", "-c", "2", "--workload", "random"]  # fmt: skip
    res = CliRunner().invoke(main, [*base, "--speculative", "ngram"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("random c=")]
    assert [ln.split(":")[0] for ln in lines] == ["random c=1 ngram", "random c=2 ngram"]
    pattern = (
        r"off [\d.]+ tok/s, on [\d.]+ tok/s, [\d.]+x; accepted \d+/\d+ \(\d+%\); "
        r"step ms: plain (-|[\d.]+ \([\d.]+ rows\)), verify (-|[\d.]+ \([\d.]+ rows\))"
    )
    assert all(re.search(pattern, ln) for ln in lines), lines
    oracle = ["--spec-oracle", "1", "--spec-oracle", "0"]  # every guess right, every one wrong
    res = CliRunner().invoke(main, [*base[:-4], "--speculative", "auto", *oracle])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("random c=")]
    modes = [ln.split(":")[0] for ln in lines]
    assert modes == [f"random c=1 {m}" for m in ("auto", "ngram", "oracle-100%", "oracle-0%")]
    assert "accepted 0/" in lines[3] and re.search(r"accepted (\d+)/\1 ", lines[2]), lines
    res = CliRunner().invoke(main, [*base, "--speculative", "off"])
    assert res.exit_code != 0 and "speculative decoding is off" in res.output
