"""`hetero plan -o plan.json` drives the pipeline: `LLM(plan=...)`, `hetero bench --plan` and
`hetero-serve --plan` run the plan's stages as real CPU stage processes (cpu,cpu: the planner's
two stages of one CPU, `cpu` and `cpu#2`, both on base device `cpu`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hetero.cli import main
from hetero.config import RuntimeConfig
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.planner.plan import Plan
from hetero.planner.specs import load_spec
from hetero.profiler.machine import ThisMachine
from hetero.sampling import SamplingParams
from tests.engine.test_engine import check_outputs

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def cached_cpu(tmp_path_factory):
    """This machine's profile cache with a CPU entry (datasheet numbers stand in for the
    measurement, which test_device_profiles makes for real: here the plan's path is tested)."""
    from hetero.profiler import machine as profile

    home = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(home))
    here = [load_spec("desktop-ddr5").replace(id="cpu", source="measured")]
    # the key holds the kernels' thread count: an engine built in this process may have set it
    # (--threads 1), a fresh process (plan_vs_bench) has the default: the entry goes under both
    code = "from hetero.profiler import machine as m; print(m.fingerprint(m.live_devices()))"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    keys = {fresh.stdout.strip(), profile.fingerprint(profile.live_devices())}
    for key in keys:
        profile.save(key, here, {})
    yield home
    mp.undo()


def make_plan(model, out, *extra: str) -> Plan:
    args = ["plan", str(model), "--devices", "cpu,cpu", "--use-all-devices", "-o", str(out)]
    res = CliRunner().invoke(main, [*args, "--kv-dtype", "fp32", "--weights", "dense", *extra])
    assert res.exit_code == 0, res.output
    return Plan.load(out)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from hetero.synth import write_synthetic

    folder = tmp_path_factory.mktemp("planpipe")
    return write_synthetic(folder / "tiny-llama.gguf", "tiny-llama", "q8_0", progress=False)


def test_plan_of_a_cpu_listed_twice(cached_cpu, tiny_llama, tmp_path):
    p = make_plan(tiny_llama, tmp_path / "plan.json", "-c", "2")
    assert [s.device for s in p.stages] == ["cpu", "cpu#2"]
    assert [s.base_device for s in p.stages] == ["cpu", "cpu"]
    assert [(s.layer_start, s.layer_end) for s in p.stages] == [(0, 2), (2, 4)]  # equal halves
    assert any("cpu runs more than one stage" in n for n in p.notes)
    assert all(s.kv_dtype == "fp32" and s.weights == "dense" for s in p.stages)


def test_a_cpu_listed_twice_is_shared_by_its_stages(cached_cpu):
    from hetero.kernels import cpu_threads
    from hetero.planner.resolve import resolve_devices

    (one,) = resolve_devices(["cpu"], ThisMachine(progress=False))
    a, b = resolve_devices(["cpu", "cpu"], ThisMachine(progress=False))
    assert (a.id, b.id) == ("cpu", "cpu#2")
    threads = cpu_threads.planned()
    f = max(1, threads // 2) / threads  # the pipeline gives each CPU stage threads // 2
    for p in (a, b):
        # free memory is read live at each call: the machine's other work moves it a little
        assert p.memory_free == pytest.approx(one.memory_free // 2, rel=0.02)
        assert p.matmul["fp16"].decode_gbs == pytest.approx(one.matmul["fp16"].decode_gbs * f)
        assert p.attn_gbs == pytest.approx(one.attn_gbs * f)
        assert p.layer_overhead_s == one.layer_overhead_s  # host work per process: unchanged


def test_llm_runs_the_plan_and_matches_one_process(cached_cpu, tiny_llama, tmp_path):
    plan_file = tmp_path / "plan.json"
    p = make_plan(tiny_llama, plan_file, "-c", "2")
    prompts = [[1, 50, 60, 70], [1, 900, 901], [1, 5, 6, 7, 8, 9]]
    llm = LLM(str(tiny_llama), plan=str(plan_file), stage_timeout=120.0)
    try:
        assert [s.device for s in llm.engine.executor.stages] == ["cpu", "cpu"]
        assert llm.engine.block_manager.num_blocks <= p.num_kv_blocks
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.engine.close()
    check_outputs(load_model(tiny_llama, RuntimeConfig(weights="dense")), prompts, outs, 8, set())


def test_bench_cli_takes_the_plan(cached_cpu, tiny_llama, tmp_path):
    plan_file = tmp_path / "plan.json"
    make_plan(tiny_llama, plan_file)
    args = ["bench", str(tiny_llama), "--plan", str(plan_file), "-n", "2", "-c", "2"]
    res = CliRunner().invoke(main, [*args, "--input-len", "8", "--output-len", "4"])
    assert res.exit_code == 0, res.output
    assert "requests 2 x (in 8, out 4), concurrency 2" in res.output
    assert "pipeline of 2 stages" in res.output and "(cpu layers 2-3)" in res.output


def test_daemon_serves_a_plan_file(cached_cpu, smollm2_path, tmp_path):
    """hetero-serve --plan plan.json (cpu,cpu), asked by the real openai client."""
    import openai

    from tests.support.server_fixture import start_daemon

    plan_file = tmp_path / "plan.json"
    make_plan(smollm2_path, plan_file, "--context", "256")
    d = start_daemon(str(smollm2_path), "--plan", str(plan_file))
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        r = client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        got = r.choices[0].text
    finally:
        assert d.finish() == 0, d.log()
    one = LLM(str(smollm2_path), kv_dtype="fp32", weights="dense", num_kv_blocks=64)
    assert got == one.generate(["The capital of France is"], GREEDY)[0].outputs[0].text


def test_plan_vs_bench_runs_a_two_stage_plan(cached_cpu, tiny_llama, tmp_path):
    """benchmarks/plan_vs_bench.py on a multi-stage plan: predicted and measured side by side."""
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_vs_bench.py"
    out = tmp_path / "rows.json"
    args = [str(tiny_llama), "--devices", "cpu,cpu", "--use-all-devices", "-c", "2"]
    args += ["--input-len", "8", "--output-len", "6", "--rounds", "1", "--json", str(out)]
    env = {**os.environ, "XDG_CACHE_HOME": str(cached_cpu)}
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    stages = r["plan"]["stages"]
    # where the split falls follows this machine's measured profile; both devices get layers
    assert [s["device"] for s in stages] == ["cpu", "cpu#2"]
    assert stages[0]["layer_start"] == 0 and stages[1]["layer_end"] == 4
    assert stages[0]["layer_end"] == stages[1]["layer_start"]
    split = ", ".join(f"{s['device']} {s['layer_start']}-{s['layer_end'] - 1}" for s in stages)
    assert f"c=2: plan {split};" in done.stdout
    assert r["measured"]["per_stream_tok_s"] > 0
    # TTFT: the median of the rounds x C requests, each kept; the host's load as measured
    each = r["measured"]["ttft_each_s"]
    assert len(each) == 2 and r["measured"]["ttft_s"] == pytest.approx(
        sorted(each)[0] / 2 + sorted(each)[1] / 2
    )
    assert "host (measured): load average " in done.stdout
    assert r["predicted"]["aggregate_tok_s"] == pytest.approx(
        2 * r["predicted"]["per_stream_tok_s"]
    )
