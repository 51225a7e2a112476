"""The factory: configs and a placement -> an Engine over the executor that runs it.

    stages None   ->  LocalExecutor   (the model on one device: execution/local.py)
    stages given  ->  PipelineExecutor (layer ranges over stage processes: pipeline/executor.py)

The engine gets the executor, the model's configuration and its tokenizer, and never learns
which executor it has. Where the stages come from (--split, a saved plan, or the planner over
this machine's devices) is decided above, in launch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from hetero.config import PipelineConfig, RuntimeConfig
from hetero.engine.config import EngineConfig, SchedulerConfig
from hetero.engine.engine import Engine
from hetero.engine.spec.draft import check_same_vocab
from hetero.execution.kv_pool import cap_gpu_memory
from hetero.execution.local import LocalExecutor
from hetero.gguf_loader import GGUFModel, load_gguf
from hetero.model.llama import LlamaModel, load_model
from hetero.pipeline.executor import PipelineExecutor
from hetero.pipeline.stages import StageSpec
from hetero.tokenizer import Tokenizer

DRAFT_KV_FRACTION = 0.1  # of the memory free after the draft's weights, before the target's KV


@dataclass(frozen=True)
class LaunchConfig:
    """Everything an engine is launched from: the engine core's config, where and how the model
    runs, and how a pipeline is asked for. Built from flat options (the command line's, or
    `LLM(**options)`) by `from_options`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    @classmethod
    def from_options(cls, **options) -> LaunchConfig:
        """Flat keyword options, each named as the config field it sets, sorted into the
        frozen configs they belong to (TypeError naming an unknown one)."""
        owners = {
            "runtime": {f.name for f in fields(RuntimeConfig)},
            "scheduler": {f.name for f in fields(SchedulerConfig)},
            "engine": {f.name for f in fields(EngineConfig)} - {"scheduler"},
            "pipeline": {f.name for f in fields(PipelineConfig)},
        }
        parts: dict[str, dict] = {k: {} for k in owners}
        for key, value in options.items():
            owner = next((k for k, names in owners.items() if key in names), None)
            if owner is None:
                known = sorted(set().union(*owners.values()))
                raise TypeError(f"unknown option {key!r}; known: {', '.join(known)}")
            parts[owner][key] = value
        engine = EngineConfig(**parts["engine"], scheduler=SchedulerConfig(**parts["scheduler"]))
        return cls(engine, RuntimeConfig(**parts["runtime"]), PipelineConfig(**parts["pipeline"]))


def assemble(
    model_path: str | Path,
    launch: LaunchConfig,
    stages: list[StageSpec] | None = None,
    progress: bool = False,
    loaded: tuple[GGUFModel, LlamaModel] | None = None,
    split_on: str | None = None,
) -> Engine:
    """The engine over `stages` (a pipeline) or over the whole model on the runtime's device.
    `loaded`: a model already in memory (load_model's pair), shared instead of loaded again.
    `split_on`: the -ngl split over this device, the CPU included (both segments there, prompt
    steps streaming to it: the same code a GPU runs, for tests); by default the runtime's GPU
    where it asks for n_gpu_layers."""
    cfg = launch.engine
    if stages:
        if loaded is not None:
            raise ValueError(
                "a pipeline loads its layers in its stage processes: it cannot share a model "
                "loaded in this process (drop `loaded`, or drop devices/split/plan)"
            )
        gguf = load_gguf(model_path)  # metadata and tokenizer only: the weights are mapped
        executor = PipelineExecutor(
            str(model_path), stages, launch.runtime, cfg, launch.pipeline, progress
        )
        return Engine(cfg, executor, gguf.config, Tokenizer.from_gguf(gguf.reader))
    rt = launch.runtime.resolved()
    if rt.gpu_memory_cap and rt.device.startswith("cuda"):
        cap_gpu_memory(rt.device, rt.gpu_memory_cap)  # before anything is loaded there
    gpu = split_on or (rt.device if _splits(rt) else None)
    if loaded is None and gpu is not None:
        gguf = load_gguf(model_path)
        models = _segments(gguf, launch.runtime, gpu, progress)
    else:
        gguf, model = loaded or load_model(model_path, rt, progress=progress)
        models = [model]
    tokenizer = Tokenizer.from_gguf(gguf.reader)
    max_len = cfg.scheduler.max_model_len or gguf.config.context_length
    # before the pool is sized: a draft model's weights and KV come out of the same memory
    draft = _draft(cfg, models[0], tokenizer, max_len) if cfg.speculative == "draft" else None
    spec_tokens = 0 if cfg.speculative == "off" else cfg.num_speculative_tokens
    executor = LocalExecutor(
        models, cfg, max_len, str(gguf.path), spec_tokens, gguf=gguf,
        offload_min_tokens=rt.offload_min_tokens,  # (and a GPU's experts kept in RAM)
        offload_device=gpu or (rt.device if rt.device.startswith("cuda") else None),
    )  # fmt: skip
    return Engine(cfg, executor, gguf.config, tokenizer, draft)


def _splits(rt: RuntimeConfig) -> bool:
    """Whether the runtime asks for layers on the CPU beside its GPU (-ngl below all)."""
    return rt.device.startswith("cuda") and rt.n_gpu_layers is not None


def _segments(gguf: GGUFModel, rt: RuntimeConfig, gpu: str, progress: bool) -> list[LlamaModel]:
    """Layers 0 .. n_gpu_layers - 1 on the GPU, the rest on the CPU (each device with its own
    weights mode and activation dtype), as llama.cpp's -ngl places them."""
    n = gguf.config.n_layers
    cut = min(rt.n_gpu_layers, n)  # as llama.cpp's -ngl 99: more than the model has means all
    parts = [(gpu, range(0, cut)), ("cpu", range(cut, n))]
    return [
        LlamaModel(gguf, rt.resolved(device), layers, progress=progress)
        for device, layers in parts
        if len(layers)
    ]


def _draft(cfg: EngineConfig, target: LlamaModel, tokenizer, max_len: int) -> LocalExecutor:
    """The draft model on the target's device: eager steps, its own small pool, no tiers."""
    gguf, model = load_model(cfg.draft_model, target.runtime)
    check_same_vocab(tokenizer, Tokenizer.from_gguf(gguf.reader), cfg.draft_model)
    own = replace(cfg, enforce_eager=True, num_kv_blocks=None)
    return LocalExecutor(model, own, max_len, kv_fraction=DRAFT_KV_FRACTION)
