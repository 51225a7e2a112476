"""The Plan: which layers run where, with which kernels and KV, and what speed to expect.

`plan(model, profiles, config)` is a pure function of a model description (shapes and tensor
types, no weights), device profiles and a PlanConfig. The Plan it returns is what a server starts
from (`hetero-serve --plan plan.json`): stages in pipeline order, each a device and a contiguous
layer range [layer_start, layer_end), its KV pool, weights mode and kernels.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero.config import RuntimeConfig, check_cpu_moe
from hetero.engine.config import EngineConfig
from hetero.planner.device import DeviceProfile
from hetero.planner.model_desc import ModelDesc

PLAN_VERSION = 1


class PlanError(ValueError):
    """No plan: the reason, with the numbers."""


@dataclass(frozen=True)
class PlanConfig:
    """What the plan is for.

    concurrency: sequences decoding at once; the split maximizes tok/s for it.
    context: tokens per sequence the KV must hold for all `concurrency` sequences at once
        (None: the model's context length, at most DEFAULT_CONTEXT_CAP).
    prompt_len / output_len: the workload whose TTFT and decode speed are predicted (decode
        reads prompt_len + output_len / 2 tokens of context on average).
    engine: the engine the plan is for: its KV dtype (engine/config.py's kv_dtype_rule, as
        the engine applies it per device), block size, KV share of the free memory, batch
        limits, and CUDA graphs (enforce_eager: decode steps pay the host's launch time;
        cuda_graph_max_tokens: prompt chunks of up to that many tokens replay graphs).
    weights: "auto" (per device the fastest mode that fits, CPUs choosing among exact modes),
        or a RuntimeConfig weights mode to force everywhere it applies (or per device).
    in_process: the stages run in one process, one after the other (a GPU's layers, then the
        CPU's: the local executor's segments, llama.cpp's -ngl): no hand-offs between stage
        processes and no micro-batches in flight; prompt steps of at least
        `offload_min_tokens` tokens run the CPU's matmuls on the GPU, weights streamed.
    use_all_devices: give every device at least one layer (to test a split where one device
        would be fastest, e.g. two MPS shares of one GPU).
    margin / margin_bytes: memory kept free on each device (a fraction of its usable memory,
        plus fixed bytes for the runtime: CUDA context, allocator slack, the process itself).
    cpu_moe / n_cpu_moe: a mixture-of-experts model's experts of every layer / of the first
        n_cpu_moe layers held in system RAM and multiplied by the CPU among the devices, the
        rest on the GPUs (llama.cpp's --cpu-moe / --n-cpu-moe). Neither: the planner keeps the
        experts with their layers, or moves the fewest layers' experts to RAM that make the
        model fit the GPUs.
    """

    concurrency: int = 1
    context: int | None = None
    prompt_len: int = 128
    output_len: int = 128
    engine: EngineConfig = field(default_factory=EngineConfig)
    weights: str = RuntimeConfig.weights
    in_process: bool = False
    offload_min_tokens: int = RuntimeConfig.offload_min_tokens
    use_all_devices: bool = False
    margin: float = 0.05
    gpu_margin_bytes: int = 768 << 20
    cpu_margin_bytes: int = 2 << 30
    cpu_moe: bool = False
    n_cpu_moe: int = 0

    def __post_init__(self) -> None:
        check_cpu_moe(self.cpu_moe, self.n_cpu_moe)
        for name in ("concurrency", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.context is not None and self.context < 2:
            raise ValueError(f"context must be >= 2, got {self.context}")
        RuntimeConfig(weights=self.weights)  # one mode, or DEVICE=MODE pairs: its own check
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


DEFAULT_CONTEXT_CAP = 8192


@dataclass(frozen=True)
class StagePlan:
    device: str  # "cuda:0", "cpu", "cuda:0@70%:32GB", or a spec name in a dry run
    layer_start: int
    layer_end: int  # exclusive
    num_kv_blocks: int
    kv_dtype: str  # "fp8" | "fp16" | "bf16" | "fp32"
    weights: str  # a RuntimeConfig weights mode
    kernels: dict[str, str]  # op -> kernel name
    predicted_step_s: float  # one decode step of a micro-batch at the asked concurrency
    name: str = ""
    bus_id: str = ""
    has_embedding: bool = False
    has_head: bool = False
    weight_bytes: int = 0
    kv_bytes: int = 0
    activation_bytes: int = 0  # activations, and in one process the CPU prompt matmuls' scratch
    memory_budget: int = 0  # usable bytes after the safety margin
    kv_room_blocks: int = 0  # blocks this device alone could hold (the pool is the stages' min)
    weights_reason: str = ""  # why this weights mode: asked, fastest that fits, or most compact
    single_step_s: float = 0.0  # one decode step of one sequence
    prefill_s: float = 0.0  # this stage's share of one prompt's prefill
    # A share of a GPU ("cuda:0@70%:32GB"): the torch device to run on, the SM percentage its
    # process starts with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and its memory cap in bytes.
    base_device: str = ""
    mps_percentage: int | None = None
    memory_cap: int = 0

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Plan:
    model: str
    n_layers: int
    stages: tuple[StagePlan, ...]
    concurrency: int
    context: int
    prompt_len: int
    output_len: int
    block_size: int
    microbatches: int  # micro-batches in flight through the pipeline at the asked concurrency
    single_stream_tok_s: float
    aggregate_tok_s: float
    ttft_s: float  # one prompt of prompt_len tokens alone
    ttft_burst_s: float  # `concurrency` prompts arriving together: their mean TTFT (burst.py)
    max_context: int  # longest context every one of `concurrency` sequences can have
    max_concurrency: int  # sequences of `context` tokens that fit at once
    model_path: str = ""  # the GGUF file planned (or "synth:SHAPE:QUANT" for a dry run)
    unused_devices: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # mixture of experts: the experts of layers [0, experts_in_ram) held in system RAM and
    # multiplied on `expert_device` (a CPU), the others with their layers
    experts_in_ram: int = 0
    expert_device: str = ""
    expert_ram_bytes: int = 0
    expert_bytes: int = 0  # all the experts' bytes (0: not a mixture-of-experts model)
    in_process: bool = False  # the stages run one after the other in one process (segments)
    version: int = PLAN_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_kv_blocks(self) -> int:
        return min(s.num_kv_blocks for s in self.stages)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
            raise ValueError(f"not a version-{PLAN_VERSION} hetero plan")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"plan has unknown fields: {', '.join(sorted(unknown))}")
        if not isinstance(d.get("stages"), list):
            raise ValueError("plan has no 'stages' list")
        stages = tuple(StagePlan(**s) for s in d.pop("stages"))
        tuples = ("unused_devices", "notes")
        return cls(stages=stages, **{k: tuple(v) if k in tuples else v for k, v in d.items()})

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"plan file not found: {path}")
        try:
            return cls.from_json(path.read_text())
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}: {e}") from e

    def check_devices(self, present: list[str]) -> None:
        """Refuse a plan whose devices are not all present now (by id)."""
        check_present([s.device for s in self.stages], present)


def check_present(devices: list[str], present: list[str]) -> None:
    """PlanError naming the devices (stage device ids, shares included) not present now."""
    missing = [d for d in devices if base_device(d) not in present]
    if missing:
        raise PlanError(
            f"the plan places layers on {', '.join(missing)}, not present now "
            f"(present: {', '.join(present) or 'none'}); make a new plan"
        )


def base_device(dev_id: str) -> str:
    """The device a stage runs on: "cuda:0" for the share "cuda:0@70%:32GB", "cpu" for "cpu#2"
    (the second stage of a CPU listed twice)."""
    return dev_id.split("@")[0].split("#")[0]


def plan(model: ModelDesc, profiles: list[DeviceProfile], config: PlanConfig) -> Plan:
    """The split of `model` over `profiles` (pipeline order) that decodes fastest at the asked
    concurrency and fits; raises PlanError with the numbers when none does."""
    from hetero.planner.placement import place

    return place(model, profiles, config)
