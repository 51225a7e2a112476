"""From options to an engine: where the layers go, then the factory.

    --split cuda:0=0-19,cpu=20-31   pipeline stages as given (one process each)
    --devices cuda:0,cpu            one GPU and the CPU: the planner's split in one process (the
                                    GPU's first layers, as -ngl), as `hetero plan` plans them; a
                                    memory cap (cuda:0@100%:8GB) caps this process there
    --devices cuda:0,cuda:1,cpu     several GPUs: the planner's split as pipeline stages
                                    (profiled once, cached), or an even split when one repeats
    --plan plan.json                a saved plan (`hetero plan -o`): in one process when it was
                                    planned so (a GPU and the CPU), else as pipeline stages
    --n-gpu-layers N                a GPU's first N layers, the rest on the CPU, one process
    none of them                    on a CPU: the whole model there; with a GPU: the planner's
                                    placement over it and the CPU, in one process (all on the
                                    GPU when it holds the model and its KV)

Stages that will run here must name devices present now: a plan made on another machine, or
before a GPU went away, is refused in one line before any stage starts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from hetero.config import PipelineConfig, check_device, device_key
from hetero.engine.engine import Engine
from hetero.factory import LaunchConfig, assemble
from hetero.gguf_loader import load_gguf
from hetero.models import resolve_model
from hetero.pipeline.stages import (
    StageSpec,
    even_split,
    parse_devices,
    parse_split,
    stages_from_plan,
)
from hetero.pipeline.worker import StageArgs, stage_main
from hetero.planner.model_desc import describe
from hetero.planner.plan import Plan, PlanConfig, check_present
from hetero.planner.plan import plan as make_plan
from hetero.planner.resolve import resolve_devices
from hetero.planner.shares import is_share, parse_share
from hetero.profiler.machine import ThisMachine, live_devices

log = logging.getLogger("hetero.pipeline")


def build_engine(
    model: str | Path | None = None,
    launch: LaunchConfig | None = None,
    progress: bool = False,
    loaded=None,
) -> Engine:
    """The engine for `model` (None: the default model) as `launch` places it. `loaded`: a model
    already in memory (load_model's pair), shared instead of loaded again (one device only)."""
    launch = launch or LaunchConfig()
    # a model already loaded names its own file (no default model needed beside it)
    path = loaded[0].path if loaded is not None and not model else resolve_model(model)
    if loaded is None:
        launch = placed(path, launch)
    stages = None
    if launch.pipeline.enabled:
        n_layers = load_gguf(path).config.n_layers
        stages = resolve_stages(path, n_layers, launch.pipeline, plan_config(launch))
        local = set(range(len(stages))) - launch.pipeline.remote_ranks()
        require_present([stages[r] for r in sorted(local)])
    return assemble(path, launch, stages, progress, loaded)


def plan_config(launch: LaunchConfig, in_process: bool = False) -> PlanConfig:
    """What the planner must plan for: this launch's KV, weights and batch limits, and its
    --max-model-len as the context each sequence's KV must hold (none given: the planner's
    default), so that a shorter context leaves the GPU more layers, as llama.cpp's -c does."""
    rt = launch.runtime
    return PlanConfig(
        engine=launch.engine,
        context=launch.engine.scheduler.max_model_len,
        weights=rt.weights,
        in_process=in_process,
        offload_min_tokens=rt.offload_min_tokens,
        cpu_moe=rt.cpu_moe,
        n_cpu_moe=rt.n_cpu_moe,
    )


def placed(path: str | Path, launch: LaunchConfig) -> LaunchConfig:
    """The launch with its placement settled: a plan file that runs in one process becomes the
    runtime's -ngl; with nothing asked (no --split, --plan, --devices, --n-gpu-layers) and a
    GPU present, the planner places the model over it and the CPU, as llama.cpp's automatic
    fit does: all on the GPU when it holds the model beside its KV (at once where the weights
    take at most FIT_SHARE of its free memory), else its first layers there and the rest on the
    CPU, each device in the weights mode the plan chose."""
    pc, rt = launch.pipeline, launch.runtime
    if pc.plan and not (pc.devices or pc.split):
        plan = _plan_file(pc.plan)
        if plan is not None and plan.in_process:
            return _running(launch, plan, reason=f"the plan {pc.plan}")
        return launch
    if pc.devices and not (pc.split or pc.plan or pc.remote_stages):
        devices = one_process_devices(pc.devices)
        if devices is not None:
            if rt.n_gpu_layers is not None:
                raise ValueError("give --devices or --n-gpu-layers, not both: the plan sets -ngl")
            profiles = resolve_devices(devices, ThisMachine())
            return _running(launch, _one_process_plan(path, profiles, launch),
                            reason=f"the planner's split over {pc.devices}")  # fmt: skip
    device = rt.resolved().device
    if pc.enabled or rt.n_gpu_layers is not None or not device.startswith("cuda"):
        return launch
    if fits_whole(path, device):  # what the plan would say, without profiling the devices
        return launch
    profiles = resolve_devices([device_key(device), "cpu"], ThisMachine())
    plan = _one_process_plan(path, profiles, launch)
    return _running(launch, plan, reason="the planner's split for the devices here")


def _one_process_plan(path: str | Path, profiles, launch: LaunchConfig) -> Plan:
    return _plan_model(path, profiles, plan_config(launch, in_process=True))


def _plan_model(path: str | Path, profiles, config: PlanConfig) -> Plan:
    """The plan of the model file at `path`; a context longer than the model's (the engine
    serves such a --max-model-len) is planned as the model's."""
    desc = describe(str(path))
    if config.context is not None and config.context > desc.config.context_length:
        config = replace(config, context=desc.config.context_length)
    return make_plan(desc, profiles, config)


# A model whose weights take at most this share of a GPU's free memory runs all there without a
# plan: the rest holds its KV and activations at any usual context, and the planner, which would
# place it all there too, first profiles the devices (minutes on a new machine)
FIT_SHARE = 0.6


def fits_whole(path: str | Path, device: str) -> bool:
    """Whether the model's file (its weights, and metadata of a few MB) fits in FIT_SHARE of
    the GPU's free memory (logged). The file's size, not its tensors: parsing the GGUF here
    would read its metadata once more at start-up, before the loader reads it."""
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    size = Path(path).stat().st_size
    if size > FIT_SHARE * free:
        return False
    log.info("placement: every layer on %s (the model file takes %.1f GB of its %.1f GB free)",
             device, size / 1e9, free / 1e9)  # fmt: skip
    return True


def _plan_file(path: str) -> Plan | None:
    """A `hetero plan -o` file (None for a hand-written stage list)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {path}: cannot read it as a JSON plan ({e})") from e
    return Plan.load(path) if isinstance(data, dict) and "version" in data else None


def _running(launch: LaunchConfig, plan: Plan, reason: str) -> LaunchConfig:
    """The launch running `plan` in this process: its GPU stage's layers on the GPU (-ngl), the
    CPU stage's on the CPU, each device in the plan's weights mode, the KV pool no larger than
    the plan's (it left the GPU room for the streamed prompt matmuls), and the GPU stage's
    memory cap (a share's, cuda:0@100%:8GB) on this process."""
    gpu = [s for s in plan.stages if not s.base_device.startswith("cpu")]
    cpu = [s for s in plan.stages if s.base_device.startswith("cpu")]
    if len(gpu) > 1 or len(cpu) > 1:
        raise ValueError("an in-process plan holds one GPU stage and one CPU stage at most")
    if gpu and gpu[0].mps_percentage is not None:
        raise ValueError(
            f"{gpu[0].device}: one process takes a GPU's memory cap only (e.g. "
            f"{gpu[0].base_device}@100%:8GB); a share of its SMs is an MPS client, a pipeline "
            "stage of its own"
        )
    weights = ",".join(f"{device_key(s.base_device)}={s.weights}" for s in plan.stages)
    device = gpu[0].base_device if gpu else "cpu"
    n_gpu = gpu[0].n_layers if gpu and cpu else None
    where = ", ".join(f"{s.base_device} layers {s.layer_start}-{s.layer_end - 1} ({s.weights})"
                      for s in plan.stages)  # fmt: skip
    if plan.experts_in_ram:  # a MoE model's first layers' experts in RAM (model/moe.py)
        where += f", the experts of layers 0-{plan.experts_in_ram - 1} in RAM"
    if gpu and gpu[0].memory_cap:
        where += f", this process held to {gpu[0].memory_cap / 1e9:g} GB of {device}"
    log.info("placement: %s; %s (%.1f tok/s, TTFT %.2f s predicted)", where, reason,
             plan.single_stream_tok_s, plan.ttft_s)  # fmt: skip
    experts = dict(cpu_moe=False, n_cpu_moe=plan.experts_in_ram) if plan.experts_in_ram else {}
    cap = gpu[0].memory_cap if gpu else 0
    rt = replace(
        launch.runtime, device=device, n_gpu_layers=n_gpu, weights=weights,
        gpu_memory_cap=cap or launch.runtime.gpu_memory_cap, **experts,
    )  # fmt: skip
    engine = launch.engine
    if engine.num_kv_blocks is None and plan.num_kv_blocks > 0:
        engine = replace(engine, num_kv_blocks=plan.num_kv_blocks)
    pipeline = replace(launch.pipeline, plan=None, devices=None)
    return replace(launch, runtime=rt, engine=engine, pipeline=pipeline)


def one_process_devices(text: str) -> list[str] | None:
    """--devices as one process runs them (one GPU, or a memory-capped share of it, and the
    CPU, none repeated), else None (pipeline stages: several GPUs, a device listed twice)."""
    devices = [d.strip() for d in text.split(",")]
    bases = [parse_share(d).base if is_share(d) else d for d in devices]
    for d in bases:
        check_device(d, "--devices: device")
    gpus = [d for d in bases if d.startswith("cuda")]
    if len(gpus) != 1 or len(set(map(device_key, bases))) < len(bases):
        return None
    return devices


def resolve_stages(
    model_path: str | Path, n_layers: int, pc: PipelineConfig, config: PlanConfig | None = None
) -> list[StageSpec] | None:
    """The stages the options ask for; None when none of them is given (one process)."""
    asked = (("--devices", pc.devices), ("--split", pc.split), ("--plan", pc.plan))
    given = [name for name, value in asked if value]
    if len(given) > 1 and given != ["--devices", "--split"]:
        raise ValueError(f"give only one of {' and '.join(given)}")
    if pc.split:
        stages = parse_split(pc.split, n_layers)
        if pc.devices and [s.device for s in stages] != parse_devices(pc.devices):
            raise ValueError(
                f"--devices {pc.devices} disagrees with the devices of --split {pc.split}"
            )
        return stages
    if pc.plan:
        return load_plan(pc.plan, n_layers)
    if pc.devices:
        return planned_split(model_path, parse_devices(pc.devices), n_layers, config)
    return None


def load_plan(path: str | Path, n_layers: int) -> list[StageSpec]:
    """Stages of a saved plan: a `hetero plan -o` file through the planner's own reader (which
    checks it), or a hand-written {"stages": [{"device", "layer_start", "layer_end"}, ...]}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {path}: cannot read it as a JSON plan ({e})") from e
    if isinstance(data, dict) and "version" in data:
        return stages_from_plan(Plan.load(path), n_layers)
    if not isinstance(data, dict) or "stages" not in data:
        raise ValueError(f"--plan {path}: expected a JSON object with a 'stages' list")
    return stages_from_plan(data, n_layers)


def planned_split(
    model_path: str | Path, devices: list[str], n_layers: int, config: PlanConfig | None = None
) -> list[StageSpec]:
    """--devices without --split: the planner's split (profiling the devices, cached), or an
    even split when a device repeats (cpu,cpu: the planner plans one stage per device)."""
    if len(set(map(device_key, devices))) < len(devices):
        log.info(
            "pipeline: %s repeats a device; %d layers split evenly", ",".join(devices), n_layers
        )
        return even_split(devices, n_layers)
    profiles = resolve_devices(devices, ThisMachine())
    result = _plan_model(model_path, profiles, config or PlanConfig())
    log.info("pipeline: the planner split %d layers over %s", n_layers, ",".join(devices))
    return stages_from_plan(result, n_layers)


def require_present(stages: list[StageSpec]) -> None:
    """The stages to start on this host must name its devices."""
    check_present([device_key(s.device) for s in stages], [d.id for d in live_devices()])


# -- `hetero stage`: one pipeline stage started by hand on another host -----------------------


def remote_stage_args(model: str | None, rank: int, options: dict) -> StageArgs:
    """A stage listed in the engine's --remote-stages, started here instead: the same model
    file, the same split (--split or --plan: both sides must agree on every stage's layers) and
    KV options, joining the engine's process group at --dist-init. It serves until the engine
    stops the pipeline, then exits 0; it exits 1 when a peer dies, so a supervisor (systemd
    Restart=always) brings it back for the engine's restart."""
    launch = LaunchConfig.from_options(**options)
    pc = launch.pipeline
    if not pc.dist_init:
        raise ValueError("--dist-init tcp://HOST:PORT (the engine host's) is required")
    if not (pc.split or pc.plan):
        raise ValueError("give the engine's --split or --plan, so both sides agree on the layers")
    path = resolve_model(model)
    stages = resolve_stages(path, load_gguf(path).config.n_layers, pc)
    if not 0 < rank < len(stages):
        raise ValueError(
            f"--rank {rank}: the pipeline has stages 0-{len(stages) - 1}, and 0 runs beside the "
            "engine"
        )
    return StageArgs(
        rank, tuple(stages), pc.dist_init, str(path), launch.runtime, launch.engine, pc, True
    )


def run_remote_stage(model: str | None, rank: int, options: dict) -> None:
    """Serve as stage `rank` until the pipeline stops (exits the process)."""
    stage_main(remote_stage_args(model, rank, options))
