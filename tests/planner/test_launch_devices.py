"""`--devices` with one GPU and the CPU: the planner's split in one process (as `hetero plan`
plans it), a share's memory cap on that process, the plan's KV pool; several GPUs stay
pipeline stages."""

from __future__ import annotations

import pytest
import torch

from hetero.config import PipelineConfig, RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.factory import LaunchConfig
from hetero.launch import _running, one_process_devices, placed
from hetero.planner.model_desc import describe
from hetero.planner.plan import PlanConfig, PlanError, plan
from hetero.planner.shares import derive_share, parse_share
from hetero.planner.specs import load_spec

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_one_gpu_and_the_cpu_run_in_one_process():
    assert one_process_devices("cuda:0,cpu") == ["cuda:0", "cpu"]
    assert one_process_devices("cuda:0@100%:5GB, cpu") == ["cuda:0@100%:5GB", "cpu"]
    assert one_process_devices("cuda:1") == ["cuda:1"]
    assert one_process_devices("cuda:0,cuda:1,cpu") is None  # two GPUs: pipeline stages
    assert one_process_devices("cpu,cpu") is None  # a device listed twice: even stages
    assert one_process_devices("cuda,cuda:0,cpu") is None  # the same GPU twice
    assert one_process_devices("cpu") is None  # no GPU: the CPU alone needs no plan
    with pytest.raises(ValueError, match="'rtx4090' is not cpu, cuda or cuda:N"):
        one_process_devices("rtx4090,cpu")  # a datasheet is for `hetero plan`, not the server


def _capped_plan(spec: str):
    card = load_spec("rtx4090").replace(id="cuda:0")
    host = load_spec("desktop-ddr5").replace(id="cpu")
    share = derive_share(card, parse_share(spec))
    model = describe("synth:llama3-8b:q4_k_m")
    return plan(model, [share, host], PlanConfig(in_process=True))


def test_a_capped_gpu_plan_runs_with_its_cap_and_kv(caplog):
    p = _capped_plan("cuda:0@100%:3GB")  # an 8B Q4_K_M (4.9 GB) spills past 3 GB
    gpu, cpu = p.stages
    assert p.in_process and gpu.memory_cap == 3_000_000_000 and cpu.device == "cpu"
    assert 0 < gpu.n_layers < p.n_layers and p.num_kv_blocks > 0
    asked = LaunchConfig(pipeline=PipelineConfig(devices="cuda:0@100%:3GB,cpu"))
    with caplog.at_level("INFO", logger="hetero.pipeline"):
        launch = _running(asked, p, "test")
    assert "this process held to 3 GB of cuda:0" in caplog.text
    rt = launch.runtime
    assert (rt.device, rt.n_gpu_layers, rt.gpu_memory_cap) == ("cuda:0", gpu.n_layers, 3 * 10**9)
    assert rt.weights == "cuda:0=quant,cpu=qdot"
    assert launch.engine.num_kv_blocks == p.num_kv_blocks  # the plan's pool, no larger
    assert not launch.pipeline.enabled  # one process, not stages
    # a pool the user bounded stays theirs
    mine = LaunchConfig(engine=EngineConfig(num_kv_blocks=7))
    assert _running(mine, p, "test").engine.num_kv_blocks == 7


def test_a_share_of_the_sms_is_refused_in_one_process():
    p = _capped_plan("cuda:0@50%:3GB")
    with pytest.raises(ValueError, match=r"memory cap only \(e\.g\. cuda:0@100%:8GB\)"):
        _running(LaunchConfig(), p, "test")


def test_devices_here_are_checked_before_anything_is_measured(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rt = RuntimeConfig(n_gpu_layers=4)
    ngl = LaunchConfig(runtime=rt, pipeline=PipelineConfig(devices="cuda:0,cpu"))
    with pytest.raises(ValueError, match="give --devices or --n-gpu-layers, not both"):
        placed(smollm2_path, ngl)
    if not torch.cuda.is_available():
        launch = LaunchConfig(pipeline=PipelineConfig(devices="cuda:0@100%:1GB,cpu"))
        with pytest.raises(PlanError, match="no device cuda:0 on this machine"):
            placed(smollm2_path, launch)
    assert not (tmp_path / "hetero").exists()  # nothing profiled, nothing cached
    # several GPUs (or cpu,cpu) are left to the pipeline's stages as before
    stages = LaunchConfig(pipeline=PipelineConfig(devices="cpu,cpu"))
    assert placed(smollm2_path, stages) == stages


@needs_gpu
@pytest.mark.gpu
def test_a_memory_cap_bounds_the_process_and_the_free_memory_it_sees():
    from hetero.execution import kv_pool

    dev = "cuda:0"
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match="is more than"):
        kv_pool.cap_gpu_memory(dev, total + 1)
    cap = torch.cuda.memory_reserved(0) + (1 << 30)
    try:
        kv_pool.cap_gpu_memory(dev, cap)
        free = kv_pool.free_memory(dev)
        assert 0 < free <= 1 << 30
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 << 30, dtype=torch.uint8, device=dev)
        x = torch.empty(free // 2, dtype=torch.uint8, device=dev)  # within the cap: fine
        assert kv_pool.free_memory(dev) < free
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        kv_pool._CAPS.clear()
        torch.cuda.empty_cache()


def test_the_one_process_plan_holds_the_context_asked():
    """--max-model-len is the context the plan's KV holds (llama.cpp's -c): a shorter one leaves
    the capped GPU more layers; one past the model's is the model's."""
    from hetero.engine.config import SchedulerConfig
    from hetero.launch import _one_process_plan

    card = load_spec("rtx4090").replace(id="cuda:0")
    host = load_spec("desktop-ddr5").replace(id="cpu")
    devices = [derive_share(card, parse_share("cuda:0@100%:5GB")), host]

    def planned(max_model_len: int | None):
        engine = EngineConfig(scheduler=SchedulerConfig(max_model_len=max_model_len))
        return _one_process_plan("synth:llama3-8b:q4_k_m", devices, LaunchConfig(engine=engine))

    default, short, long = planned(None), planned(1024), planned(10**6)
    assert (default.context, short.context, long.context) == (8192, 1024, 8192)
    assert short.stages[0].n_layers > default.stages[0].n_layers == long.stages[0].n_layers


@needs_gpu
@pytest.mark.gpu
def test_gpu_a_capped_plan_runs_in_one_process_within_its_cap(tmp_path):
    """A plan of a 1B over 1.8 GB of the card and the CPU (its first layers there), run as
    hetero-serve --plan runs it: one process, the GPU's layers as -ngl, the allocator held to the
    cap; prompts and decode steps run (the prompt's CPU layers streamed to the GPU)."""
    import gc

    from hetero.bench import run_bench
    from hetero.engine.config import SchedulerConfig
    from hetero.execution import kv_pool
    from hetero.launch import build_engine
    from hetero.synth import write_synthetic

    path = write_synthetic(tmp_path / "l1b.gguf", "llama3.2-1b", "q4_k_m", progress=False)
    card = load_spec("rtx4090").replace(id="cuda:0")
    host = load_spec("desktop-ddr5").replace(id="cpu")
    share = derive_share(card, parse_share("cuda:0@100%:1.8GB"))
    p = plan(describe(str(path)), [share, host], PlanConfig(in_process=True, context=512))
    gpu, cpu = p.stages
    assert 0 < gpu.n_layers < p.n_layers and p.in_process
    (tmp_path / "plan.json").write_text(p.to_json())
    engine_cfg = EngineConfig(speculative="off", scheduler=SchedulerConfig(max_model_len=512))
    launch = LaunchConfig(
        engine=engine_cfg, pipeline=PipelineConfig(plan=str(tmp_path / "plan.json"))
    )
    assert placed(path, launch).runtime.n_gpu_layers == gpu.n_layers
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    engine = None
    try:
        engine = build_engine(path, launch)
        result = run_bench(engine, 2, 1, 96, 8, seed=1)  # 96 tokens: the CPU layers streamed
        assert len(result.ttft_s) == 2 and len(result.itl_s) > 0
        assert torch.cuda.max_memory_reserved(0) <= 1.8e9
        assert kv_pool.free_memory("cuda:0") <= 1.8e9 - torch.cuda.memory_reserved(0)
    finally:
        if engine is not None:
            engine.close()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        kv_pool._CAPS.clear()
        gc.collect()
        torch.cuda.empty_cache()
