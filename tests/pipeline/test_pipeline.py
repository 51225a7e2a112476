"""Pipelines of real stage processes on the CPU (gloo): same greedy output as one process.

Every pipeline here is real: spawned stage processes, activations over torch.distributed, the
sampler in the last stage. Outputs are compared with the single-process greedy reference on fp32
KV and exact (dense) weights; as in test_engine, a token may differ only at a near-tie of the
reference logits (< 1e-3), where other batch shapes round differently in the last bits. Pools
are small so the micro-batch groups preempt each other's neighbours; stage_timeout bounds every
wait, so a broken pipeline fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hetero.config import RuntimeConfig
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.structured_outputs import StructuredOutputsParams
from tests.engine.test_engine import _divergence_gap, check_outputs, prompts_mixed, ref_greedy

EXACT = dict(kv_dtype="fp32", weights="dense", stage_timeout=120.0)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
N = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMA = StructuredOutputsParams(
    json={
        "type": "object",
        "properties": {"n": N},
        "required": ["n"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hetero.synth import write_synthetic

    folder = tmp_path_factory.mktemp("pipeline")
    return write_synthetic(folder / "tiny-llama.gguf", "tiny-llama", "q8_0", progress=False)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from hetero.synth import write_synthetic

    folder = tmp_path_factory.mktemp("pipeline")
    return write_synthetic(folder / "tiny-qwen2.gguf", "tiny-qwen2", "q8_0", progress=False)


def run_pipeline(path, prompts, params=GREEDY, **options):
    """Outputs, and the engine's preemption count, of one pipeline that is closed after."""
    llm = LLM(str(path), **{**EXACT, **options})
    try:
        outs = llm.generate(prompts, params)
        bm = llm.engine.block_manager
        bm.check()
        assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
        return outs, llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.close()


def synth_prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(10, 3000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_two_stages_tiny_llama_concurrent_with_preemption(tiny_llama):
    prompts = synth_prompts(12)
    outs, preempted = run_pipeline(
        tiny_llama,
        prompts,
        devices="cpu,cpu",
        num_kv_blocks=12,
        block_size=8,
        max_num_batched_tokens=48,
        max_num_seqs=12,
    )
    assert preempted > 0, "the pool was meant to force preemption"
    loaded = load_model(tiny_llama, RuntimeConfig(weights="dense"))
    check_outputs(loaded, prompts, outs, GREEDY.max_tokens, set())


def test_three_stages_tied_embeddings_uneven_split(tiny_qwen2):
    """tiny-qwen2: 3 layers, lm_head tied to the embedding (the last stage keeps the table)."""
    prompts = synth_prompts(6, seed=1)
    outs, _ = run_pipeline(tiny_qwen2, prompts, split="cpu=0-0,cpu=1-1,cpu=2-2", num_kv_blocks=64)
    loaded = load_model(tiny_qwen2, RuntimeConfig(weights="dense"))
    check_outputs(loaded, prompts, outs, GREEDY.max_tokens, set())


@pytest.mark.parametrize("split", ["cpu=0-1,cpu=2-3", "cpu=0-0,cpu=1-2,cpu=3-3"])
def test_stages_decode_through_the_static_graph_buffers(tiny_llama, split, caplog):
    """The path a GPU stage replays from CUDA graphs, run uncaptured on the CPU: first stage
    tokens in / hidden out, middle hidden in / out, last hidden in / logits. The forced reference
    kernels (which read the buffers' tensor metadata) reach the stage processes; decode batches
    of 1..3 pad to buckets 1, 2, 4 (max_num_seqs 8 over 2 or 3 groups); 16-token steps cut the
    prompts into chunks beside running decodes, which take the larger buckets."""
    import logging

    from hetero.kernels.registry import forcing

    caplog.set_level(logging.INFO, logger="hetero.pipeline")
    prompts = synth_prompts(6, seed=8)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 7, 10)
    ]
    with forcing({"kv_write": "torch", "paged_attention": "torch"}):
        outs, _ = run_pipeline(
            tiny_llama, prompts, params, split=split, num_kv_blocks=64, max_num_seqs=8,
            max_model_len=96, max_num_batched_tokens=16,
        )  # fmt: skip
    n, top = split.count(",") + 1, 4 if "0-1" in split else 3
    paths = "; ".join([f"static buffers up to batch {top}, prompt steps up to 16 rows"] * n)
    assert f"decode steps per stage: {paths}" in caplog.text
    loaded = load_model(tiny_llama, RuntimeConfig(weights="dense"))
    for prompt, out, p in zip(prompts, outs, params):
        check_outputs(loaded, [prompt], [out], p.max_tokens, set())


@pytest.fixture(scope="module")
def smollm2_refs(smollm2_path, smollm2):
    """The prompts, the one-process model and its greedy outputs (computed once: slow here)."""
    loaded = load_model(smollm2_path, RuntimeConfig(weights="dense"))
    prompts = prompts_mixed(smollm2, n=8)
    eos = smollm2.eos_ids
    return prompts, loaded, [ref_greedy(loaded, p, GREEDY.max_tokens, eos) for p in prompts]


@pytest.mark.parametrize("devices", ["cpu,cpu", "cpu,cpu,cpu"])
def test_smollm2_pipeline_equals_one_process(smollm2_path, smollm2_refs, devices):
    prompts, loaded, want = smollm2_refs
    outs, preempted = run_pipeline(
        smollm2_path,
        prompts,
        devices=devices,
        num_kv_blocks=14,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert preempted > 0, "the pool was meant to force preemption"
    for prompt, out, ref in zip(prompts, outs, want):
        got = out.outputs[0].token_ids
        if got != ref:  # only at a near-tie (see the module's docstring)
            k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            gap = _divergence_gap(loaded[1], prompt, ref, k)
            assert gap < 1e-3, f"output differs at token {k} where the top-2 gap is {gap:.2e}"


def test_logprobs_seeded_and_constrained_sampling_in_the_last_stage(tiny_llama):
    one = LLM(str(tiny_llama), **EXACT, num_kv_blocks=64)
    eos = min(one.engine.tokenizer.eos_ids)
    p = [
        SamplingParams(temperature=0, max_tokens=4, logprobs=3),
        SamplingParams(temperature=0.8, seed=7, max_tokens=6, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=SCHEMA),  # masks shipped
        # EOS all but forced by its bias, held back by min_tokens: the last stage knows the ids
        SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100}),
    ]
    prompts = synth_prompts(4, seed=3)
    want = one.generate(prompts, p)
    got, _ = run_pipeline(tiny_llama, prompts, p, devices="cpu,cpu", num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got[2].outputs[0].finish_reason == "stop"  # the object closed
    assert json.loads(got[2].outputs[0].text).keys() == {"n"}
    ended = got[3].outputs[0]
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 4, ended


def test_killed_stage_fails_requests_restarts_then_gives_up(tiny_llama):
    llm = LLM(str(tiny_llama), **{**EXACT, "stage_timeout": 60.0}, devices="cpu,cpu",
              num_kv_blocks=64, max_restarts=1)  # fmt: skip
    eng = llm.engine
    try:
        for i, prompt in enumerate(synth_prompts(3, seed=4)):
            eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        os.kill(eng.executor.pipeline.procs[1].pid, signal.SIGKILL)
        t0, outs = time.monotonic(), []
        while eng.has_unfinished() and time.monotonic() - t0 < 90:
            outs += eng.step()
        failed = [o for o in outs if o.error]
        assert {o.request_id for o in failed} == {"r0", "r1", "r2"}
        assert all(o.finished and o.finish_reason == "abort" for o in failed)
        assert "stage 1 (cpu layers 2-3) killed by SIGKILL" in failed[0].error
        assert eng.restarts == 1
        # the restarted pipeline serves new requests
        again = llm.generate([synth_prompts(1, seed=5)[0]], GREEDY)[0]
        assert len(again.outputs[0].token_ids) == GREEDY.max_tokens
        eng.add_request("late", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        eng.step()
        os.kill(eng.executor.pipeline.procs[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="stage 0 .* killed by SIGKILL.*giving up"):
            while eng.has_unfinished():
                eng.step()
    finally:
        eng.close()
    assert all(not p.is_alive() for p in eng.executor.pipeline.procs.values())


def test_stage_started_by_hand_joins_over_tcp(tiny_llama):
    """The second-host path over loopback: stage 1 is `hetero stage`, started like on a host B."""
    from tests.support.server_fixture import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    common = ["--split", "cpu=0-1,cpu=2-3", "--kv-dtype", "fp32", "--weights", "dense",
              "--num-kv-blocks", "64", "--dist-init", init]  # fmt: skip
    cmd = [sys.executable, "-m", "hetero.cli", "stage", str(tiny_llama), "--rank", "1", *common]
    remote = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(str(tiny_llama), **EXACT, split="cpu=0-1,cpu=2-3", num_kv_blocks=64,
                  dist_init=init, remote_stages="1")  # fmt: skip
        assert list(llm.engine.executor.pipeline.procs) == [
            0
        ]  # only stage 0 is this engine's child
        prompts = synth_prompts(4, seed=6)
        outs = llm.generate(prompts, GREEDY)
        llm.engine.close()
        assert remote.wait(timeout=60) == 0, remote.stdout.read()
    finally:
        remote.kill()
    loaded = load_model(tiny_llama, RuntimeConfig(weights="dense"))
    check_outputs(loaded, prompts, outs, GREEDY.max_tokens, set())


def test_daemon_on_two_stages_serves_the_openai_client(smollm2_path):
    """hetero-serve --devices cpu,cpu, asked by the real openai client, 4 requests at once."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.support.server_fixture import start_daemon

    opts = ["--kv-dtype", "fp32", "--weights", "dense", "--num-kv-blocks", "64"]
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time"]
    d = start_daemon(str(smollm2_path), "--devices", "cpu,cpu", *opts)
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=300)
        name = client.models.list().data[0].id

        def ask(prompt: str) -> str:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
    finally:
        assert d.finish() == 0, d.log()
    one = LLM(str(smollm2_path), kv_dtype="fp32", weights="dense", num_kv_blocks=64)
    want = [o.outputs[0].text for o in one.generate(prompts, GREEDY)]
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["cuda:0=0-1,cpu=2-3", "cuda:0=0-1,cuda:0=2-3"])
def test_gpu_stages_match_the_cpu(tiny_llama, split, caplog):
    """GPU+CPU (a bf16-or-fp32 GPU hands fp32 to the CPU) and two stages on one GPU (gloo); GPU
    stages replay decode CUDA graphs, the CPU stage keeps its own eager path."""
    import logging

    caplog.set_level(logging.INFO, logger="hetero.pipeline")
    prompts = synth_prompts(8, seed=7)
    outs, _ = run_pipeline(tiny_llama, prompts, split=split, dtype="fp32", num_kv_blocks=64)
    first = "CUDA graphs up to batch 128, prompt steps up to 512 rows; "
    want = first + ("eager" if "cpu" in split else "CUDA graphs")
    assert f"decode steps per stage: {want}" in caplog.text
    loaded = load_model(tiny_llama, RuntimeConfig(weights="dense"))
    check_outputs(loaded, prompts, outs, GREEDY.max_tokens, set())


def test_bad_split_is_a_clear_cli_error(tiny_llama):
    from click.testing import CliRunner

    from hetero.cli import main

    res = CliRunner().invoke(main, ["bench", str(tiny_llama), "--split", "cpu=0-1,cpu=3-3"])
    assert res.exit_code != 0
    assert "starts at layer 3, expected 2" in res.output
