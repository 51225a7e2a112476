"""A pipeline's start: several pipelines one after the other in one process, and a start that
cannot finish fails within --stage-timeout naming the stage and the phase it is stuck in."""

from __future__ import annotations

import time

import pytest

from hetero.llm import LLM
from hetero.pipeline.processes import StageFailure, free_port
from hetero.sampling import SamplingParams
from tests.pipeline.test_pipeline import EXACT, GREEDY, run_pipeline, synth_prompts, tiny_llama  # noqa: F401


def test_pipelines_one_after_another_in_one_process(tiny_llama):  # noqa: F811
    """A one-process engine first (as the benchmark's reference row), then two pipelines in a
    row: each starts on its own port and gives the reference's greedy tokens."""
    prompts = synth_prompts(4, seed=3)
    one = LLM(str(tiny_llama), kv_dtype="fp32", weights="dense", num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    one.engine.close()
    for split in ("cpu=0-1,cpu=2-3", "cpu=0-2,cpu=3-3"):
        outs, _ = run_pipeline(tiny_llama, prompts, split=split, num_kv_blocks=64)
        assert [o.outputs[0].token_ids for o in outs] == want, split


def test_start_that_cannot_finish_names_stage_and_phase(tiny_llama, caplog):  # noqa: F811
    """Stage 1 is declared remote and never started: stage 0 waits at the rendezvous, and the
    engine gives up after stage_timeout with the stage and its phase in the error."""
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="hetero.pipeline"), pytest.raises(StageFailure) as err:
        LLM(
            str(tiny_llama),
            **{**EXACT, "stage_timeout": 8.0},
            devices="cpu,cpu",
            dist_init=f"tcp://127.0.0.1:{free_port()}",
            remote_stages="1",
            max_restarts=0,
        )
    took = time.monotonic() - t0
    msg = str(err.value)
    assert "not ready within --stage-timeout 8 s" in msg
    assert "stage 0 (cpu layers 0-1) at 'joining the process group" in msg
    assert took < 60, took  # bounded by the timeout (plus spawn and kill), not a hang
    assert "stage 0 (cpu layers 0-1): joining the process group" in caplog.text


def test_stage_without_memory_for_its_kv_fails_at_once_with_the_reason(tiny_llama):  # noqa: F811
    """A KV share too small for one block: the stages fail while sizing their pools, and the
    engine reports why (not a wait for the timeout)."""
    t0 = time.monotonic()
    with pytest.raises(StageFailure) as err:
        LLM(
            str(tiny_llama),
            **{**EXACT, "stage_timeout": 300.0},
            devices="cpu,cpu",
            kv_memory_fraction=1e-12,
            max_restarts=0,
        )
    msg = str(err.value)
    # which notices first, the stage's death report or its closed pipe, is a race: both say why
    assert "a stage died while starting" in msg or "closed while starting" in msg
    assert "no room for a KV block on cpu" in msg
    assert time.monotonic() - t0 < 120  # seen when the stage exits, long before the timeout


@pytest.mark.gpu
def test_gpu_two_stages_on_one_gpu_after_a_one_process_engine(tiny_llama):  # noqa: F811
    """The benchmark's order on a GPU: a one-process CUDA engine (its RAM KV tier pinned, its
    CUDA context alive in this process), then two stages sharing cuda:0, in bf16 with fp8 KV
    as the benchmark runs; the pipeline starts within its timeout and matches token for token
    for the first steps (bf16 near-ties may flip later)."""
    prompts = synth_prompts(4, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one = LLM(str(tiny_llama), device="cuda:0", kv_dtype="fp8", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    one.engine.close()
    split = "cuda:0=0-1,cuda:0=2-3"
    two = LLM(str(tiny_llama), split=split, kv_dtype="fp8", num_kv_blocks=256, stage_timeout=120)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    finally:
        two.engine.close()
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 3, (got, want)


def test_mps_shares_without_the_daemon_fail_at_once(tiny_llama, tmp_path, monkeypatch):  # noqa: F811
    """A plan with MPS shares where no MPS daemon runs is refused before any stage starts (the
    shares would be silently ignored: two stages on the whole GPU)."""
    import json

    from hetero.pipeline import processes as pipeline

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no control socket there
    monkeypatch.setattr(pipeline.glob, "glob", lambda pattern: [])  # and no daemon process
    stages = [
        {"device": "cpu", "layer_start": 0, "layer_end": 2, "mps_percentage": 60},
        {"device": "cpu", "layer_start": 2, "layer_end": 4, "mps_percentage": 40},
    ]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": stages}))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no MPS daemon is running.*nvidia-cuda-mps-control -d"):
        LLM(str(tiny_llama), **EXACT, plan=str(plan))
    assert time.monotonic() - t0 < 5
    (tmp_path / "control").touch()  # the daemon's socket: the check passes
    assert pipeline.mps_running()


def test_mps_share_reaches_the_stage_process_environment(monkeypatch):
    """The share is in the spawned stage's environment from its start (CUDA reads it when the
    process first initializes, which an import can do), and the engine's is left as it was."""
    import multiprocessing as mp

    from hetero.pipeline.processes import _spawn_env
    from hetero.pipeline.stages import StageSpec

    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_read_env, args=(q,))
    with _spawn_env(StageSpec("cuda:0", 0, 2, mps_percentage=30)):
        p.start()
    assert q.get(timeout=60) == "30"
    p.join(30)
    import os

    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ


def _read_env(q) -> None:
    import os

    q.put(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))


def test_stage_clock_times_decode_and_prompt_steps_apart(monkeypatch) -> None:
    """The stage log's clock: per-lap means, decode-only steps apart from steps with prompt
    tokens (a prefill step would otherwise hide in the decode steps' mean), and the idle time
    before the first step left out."""
    from hetero.pipeline import worker

    now = iter([0.0, 5.0, 5.001, 5.002, 5.003, 5.103, 5.104, 5.105, 5.108, 5.109])
    monkeypatch.setattr(worker.time, "perf_counter", lambda: next(now))
    clock = worker._Clock()  # t = 0
    for what in ("waiting", "running prompt tokens", "passing on"):  # 5 s idle, then 1 ms each
        clock.lap(what)
    for what in ("waiting", "running prompt tokens", "passing on"):  # 1, 100, 1 ms
        clock.lap(what)
    clock.lap("waiting")  # 1 ms
    clock.lap("running decodes")  # 3 ms
    assert clock.report() == (
        "3 steps, ms per step: running prompt tokens 50.50 (2x), passing on 1.00, "
        "waiting 1.00, running decodes 3.00 (1x)"
    )
