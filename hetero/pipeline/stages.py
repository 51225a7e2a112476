"""Which layers run where: stage specs from --devices, --split or a saved plan.

A pipeline is a list of StageSpecs covering the model's layers in order, each a contiguous range
[layer_start, layer_end) on one device:

    --split cuda:0=0-19,cpu=20-31   ->  [StageSpec("cuda:0", 0, 20), StageSpec("cpu", 20, 32)]
    --devices cpu,cpu  (30 layers)  ->  [StageSpec("cpu", 0, 15), StageSpec("cpu", 15, 30)]

Ranges on the command line are inclusive (as people count layers); StageSpec's end is exclusive
(as Python's range is).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from hetero.config import check_device

log = logging.getLogger("hetero.pipeline")

_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: layers [layer_start, layer_end) on `device`.

    num_kv_blocks caps the stage's KV pool (None: as its free memory allows); kv_dtype and weights
    override the engine's for this stage only (None: the engine's), e.g. a plan choosing int8
    CPU weights for the stage that spills off the GPU. mps_percentage: the share of the GPU's
    SMs this stage's process may use under CUDA MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so two
    stages on one GPU can stand in for two unequal GPUs. n_cpu_moe: a plan's experts in RAM,
    those of layers 0 .. n_cpu_moe - 1 (a stage's among them multiplied on its host's CPU);
    None: as the runtime asks (--cpu-moe / --n-cpu-moe).
    """

    device: str
    layer_start: int
    layer_end: int
    num_kv_blocks: int | None = None
    kv_dtype: str | None = None
    weights: str | None = None
    mps_percentage: int | None = None
    n_cpu_moe: int | None = None

    def __post_init__(self) -> None:
        check_device(self.device, "stage device")
        if self.mps_percentage is not None and not 0 < self.mps_percentage <= 100:
            raise ValueError(f"stage mps_percentage must be in 1..100, got {self.mps_percentage}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(
                f"stage on {self.device}: layers [{self.layer_start}, {self.layer_end}) are empty "
                "or negative"
            )

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    def describe(self) -> str:
        return f"{self.device} layers {self.layer_start}-{self.layer_end - 1}"


def validate_stages(stages: list[StageSpec], n_layers: int) -> list[StageSpec]:
    """The stages must cover layers 0 .. n_layers - 1 in order, each exactly once."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    expect = 0
    for s in stages:
        if s.layer_start != expect:
            raise ValueError(
                f"stage {s.describe()} starts at layer {s.layer_start}, expected {expect}: "
                "ranges must be contiguous, in order, without gaps or overlaps"
            )
        expect = s.layer_end
    if expect != n_layers:
        raise ValueError(
            f"the stages cover layers 0-{expect - 1} but the model has {n_layers} layers "
            f"(0-{n_layers - 1})"
        )
    return stages


def parse_devices(text: str) -> list[str]:
    """'cuda:0,cuda:1,cpu' -> ['cuda:0', 'cuda:1', 'cpu']."""
    devices = [d.strip() for d in text.split(",")]
    if not text.strip() or any(not d for d in devices):
        raise ValueError(f"--devices {text!r}: expected a comma-separated list like cuda:0,cpu")
    return [check_device(d, "--devices: device") for d in devices]


def parse_split(text: str, n_layers: int) -> list[StageSpec]:
    """'cuda:0=0-19,cpu=20-31' -> stages; ranges are inclusive on the command line."""
    stages = []
    for part in text.split(","):
        device, eq, span = part.strip().partition("=")
        m = _RANGE.match(span.strip())
        if not eq or m is None:
            raise ValueError(
                f"--split: {part.strip()!r} is not DEVICE=FIRST-LAST (e.g. cpu=0-14), "
                "layers counted from 0, both ends included"
            )
        first, last = int(m.group(1)), int(m.group(2))
        if last < first:
            raise ValueError(f"--split: {part.strip()!r} ends before it starts")
        check_device(device.strip(), "--split: device")
        stages.append(StageSpec(device.strip(), first, last + 1))
    return validate_stages(stages, n_layers)


def even_split(devices: list[str], n_layers: int) -> list[StageSpec]:
    """Layers shared as evenly as counts allow, the earlier stages taking the remainder."""
    if len(devices) > n_layers:
        raise ValueError(f"{len(devices)} devices for {n_layers} layers: at most one per layer")
    q, r = divmod(n_layers, len(devices))
    stages, start = [], 0
    for i, d in enumerate(devices):
        end = start + q + (i < r)
        stages.append(StageSpec(d, start, end))
        start = end
    return stages


def stages_from_plan(plan: Any, n_layers: int) -> list[StageSpec]:
    """Adapter from the planner's Plan (duck-typed: .stages with .device, .layer_start,
    .layer_end, and optionally .base_device, .num_kv_blocks, .kv_dtype, .weights,
    .mps_percentage; and .experts_in_ram) or its JSON dict."""
    raw = plan["stages"] if isinstance(plan, dict) else plan.stages
    top = plan.get if isinstance(plan, dict) else (lambda k, d=None: getattr(plan, k, d))
    experts = int(top("experts_in_ram") or 0) or None  # a MoE plan's experts in RAM
    stages = []
    for i, s in enumerate(raw):
        get = s.get if isinstance(s, dict) else (lambda k, d=None, s=s: getattr(s, k, d))
        try:
            device, start, end = get("device"), int(get("layer_start")), int(get("layer_end"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"plan stage {i}: needs device, layer_start and layer_end") from e
        if get("base_device"):  # the planner's own: "cpu#2" and "cuda:0@70%:32GB" resolved
            device, mps = str(get("base_device")), get("mps_percentage")
        else:
            device, mps = _plan_device(str(device), get("mps_percentage"))
        weights = get("weights")
        stages.append(
            StageSpec(
                device,
                start,
                end,
                get("num_kv_blocks"),
                get("kv_dtype"),
                weights if isinstance(weights, str) else None,
                mps,
                experts,
            )
        )
    return validate_stages(stages, n_layers)


def _plan_device(device: str, mps: int | None) -> tuple[str, int | None]:
    """The planner's GPU share "cuda:0@70%:32GB" -> ("cuda:0", 70): the stage runs on cuda:0
    with 70% of its SMs under MPS (its memory share is already in the plan's block count)."""
    base, at, share = device.partition("@")
    if not at:
        return device, mps
    pct = share.split("%")[0]
    if not pct.isdigit():
        raise ValueError(f"plan stage device {device!r}: expected DEVICE@PERCENT%[:MEMORY]")
    return base, int(pct)
