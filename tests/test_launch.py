"""Placement at launch: a plan that runs in one process becomes the runtime's -ngl split; the
weights a device is asked for are checked once, by the config; bad placements say why."""

from __future__ import annotations

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.factory import LaunchConfig
from hetero.launch import _running, build_engine, fits_whole, placed
from hetero.llm import LLM
from hetero.planner.model_desc import describe
from hetero.planner.plan import PlanConfig, PlanError, plan
from hetero.planner.specs import load_spec
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch")
    return write_synthetic(folder / "tiny.gguf", "tiny-llama", "q4_k_m", progress=False)


def test_a_one_process_plan_becomes_the_runtime_split():
    """70B on a 24 GB card and a desktop CPU: the GPU's layers, then the CPU's, each device in
    the mode the plan chose, in one process (no pipeline)."""
    gpu, cpu = (
        load_spec("rtx4090").replace(id="cuda:0"),
        load_spec("desktop-ddr5").replace(id="cpu"),
    )
    p = plan(describe("synth:llama3.1-70b:q4_k_m"), [gpu, cpu], PlanConfig(in_process=True))
    assert p.in_process and [s.device for s in p.stages] == ["cuda:0", "cpu"]
    rt = _running(LaunchConfig(), p, "test").runtime
    assert rt.device == "cuda:0" and rt.n_gpu_layers == p.stages[0].n_layers
    assert rt.weights_for("cuda:0") == "quant" and rt.weights_for("cpu") == "qdot"
    # one process: no hand-off priced, prompt steps' CPU matmuls on the GPU (faster TTFT), for
    # which the GPU keeps room (their staging and bf16 scratch: a layer or two fewer there)
    piped = plan(describe("synth:llama3.1-70b:q4_k_m"), [gpu, cpu], PlanConfig())
    assert p.ttft_s < piped.ttft_s
    assert p.stages[0].activation_bytes > piped.stages[0].activation_bytes
    assert p.stages[0].n_layers <= piped.stages[0].n_layers


def test_a_saved_cpu_plan_runs_in_this_process(tiny, tmp_path):
    gpu_free = PlanConfig(in_process=True, weights="fp16")
    p = plan(describe(str(tiny)), [load_spec("desktop-ddr5").replace(id="cpu")], gpu_free)
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    launch = LaunchConfig.from_options(plan=str(path))
    assert not placed(tiny, launch).pipeline.enabled  # no stage processes
    llm = LLM(str(tiny), plan=str(path), num_kv_blocks=32)
    assert type(llm.engine.executor).__name__ == "LocalExecutor"
    assert llm.engine.executor.model.runtime.weights == "fp16"
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_placement_and_weights_are_refused_clearly(tiny):
    with pytest.raises(ValueError, match="'quant' on a CPU runs the torch reference"):
        build_engine(str(tiny), LaunchConfig(runtime=RuntimeConfig(device="cpu", weights="quant")))
    with pytest.raises(ValueError, match="is for the CPU"):
        RuntimeConfig(device="cuda", weights="qdot").weights_mode()
    with pytest.raises(ValueError, match="not DEVICE=MODE"):
        RuntimeConfig(weights="cuda:0=quant,qdot")
    with pytest.raises(ValueError, match="is not one of"):
        RuntimeConfig(weights="cpu=int3")
    assert RuntimeConfig(weights="cuda:0=dense,cpu=fp16").weights_for("cuda") == "dense"
    assert RuntimeConfig(weights="cuda:0=dense").weights_for("cpu") == "auto"
    cpu = load_spec("desktop-ddr5").replace(id="cpu")
    with pytest.raises(PlanError, match="'quant' on cpu runs the torch reference"):
        plan(describe(str(tiny)), [cpu], PlanConfig(weights="cpu=quant"))
    gpu = load_spec("rtx4090").replace(id="cuda:0")
    with pytest.raises(PlanError, match="CPU packing: a GPU runs quant or dense"):
        plan(describe(str(tiny)), [gpu], PlanConfig(weights="cuda:0=qdot"))
    with pytest.raises(ValueError, match="n_gpu_layers"):
        RuntimeConfig(n_gpu_layers=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_that_fits_the_card_is_placed_without_profiling(tiny, tmp_path, monkeypatch):
    """No split asked and weights far below the free memory: all layers on the GPU at once,
    and no device profile is measured (none is written to the cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    launch = LaunchConfig.from_options(device="cuda")
    assert fits_whole(tiny, "cuda")
    assert placed(tiny, launch) == launch
    assert not any(tmp_path.rglob("*.json"))
