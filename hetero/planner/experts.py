"""Where a mixture-of-experts model's experts go: with their layers, or in system RAM.

Experts are most of a MoE model's bytes but few of them work on each token (Qwen3-30B-A3B: 8
of 128 a layer), so on a GPU too small for the whole model they can stay in RAM and multiply on
the CPU while attention, the router and everything else run on the GPU (llama.cpp's --cpu-moe,
--n-cpu-moe N: the first N layers' experts). The cost model prices them on the CPU
(cost.DeviceCost.ram_experts); here: which layers, checked against the model and the devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hetero.planner.device import DeviceProfile
from hetero.planner.model_desc import ModelDesc
from hetero.planner.plan import Plan, PlanConfig, PlanError


def ram_expert_layers(desc: ModelDesc, cfg: PlanConfig, devices: list[DeviceProfile]) -> int:
    """The layers whose experts --cpu-moe / --n-cpu-moe put in RAM (0 where no GPU takes the
    rest: a CPU-only plan holds everything in RAM anyway)."""
    asked = desc.n_layers if cfg.cpu_moe else cfg.n_cpu_moe
    if not asked:
        return 0
    if not desc.config.is_moe:
        raise PlanError(
            f"--cpu-moe / --n-cpu-moe: {desc.name} ({desc.config.arch}) has no experts: it is "
            "not a mixture-of-experts model"
        )
    if asked > desc.n_layers:
        raise PlanError(f"--n-cpu-moe {asked}: the model has only {desc.n_layers} layers")
    if all(d.is_cpu for d in devices):
        return 0
    expert_host([d for d in devices if d.is_cpu])
    return asked


def expert_host(cpus: list[DeviceProfile]) -> DeviceProfile:
    """The CPU whose RAM holds the experts and whose cores multiply them (the first given)."""
    if not cpus:
        raise PlanError(
            "experts in RAM (--cpu-moe / --n-cpu-moe) need a CPU among the devices, whose RAM "
            "holds them and whose cores multiply them: e.g. --devices cuda:0,cpu"
        )
    return cpus[0]


def check_ram(desc: ModelDesc, host: DeviceProfile, layers: int, budget: float) -> None:
    """PlanError unless the host's RAM holds the experts of the first `layers` layers (they
    stay in their GGUF blocks there: their file bytes)."""
    need = desc.expert_bytes(range(layers))
    if need > budget:
        raise PlanError(
            f"the experts of layers 0-{layers - 1} take {need / 1e9:.2f} GB; {host.id}'s RAM "
            f"has {max(budget, 0) / 1e9:.2f} GB for them (after the safety margin)"
        )


def may_move_experts(desc: ModelDesc, devices: list[DeviceProfile], cfg: PlanConfig) -> bool:
    """Whether the planner may put experts in RAM by itself: a MoE model, no placement of
    experts asked, GPUs and a CPU among the devices."""
    kinds = {d.is_cpu for d in devices}
    return desc.config.is_moe and not (cfg.cpu_moe or cfg.n_cpu_moe) and kinds == {True, False}


def experts_or_layers(n_layers: int, place: Callable[..., tuple[Plan | None, Any]]):
    """A MoE model on GPUs and a CPU: on the GPUs alone where it fits them, else the faster
    (aggregate tok/s) of the fewest layers' experts in RAM and the last layers on the CPU.
    place(n, spill): (the plan with the first n layers' experts in RAM, or None; the last
    setup tried); spill: the CPU may take the last layers. Returns what place returns."""
    gpus_only, last = place(0, spill=False)
    if gpus_only is not None:
        return gpus_only, last
    in_ram = fewest_experts_in_ram(n_layers, lambda n: place(n)[0])
    spilled, last = place(0)
    found = [p for p in (in_ram, spilled) if p is not None]
    return max(found, key=lambda p: p.aggregate_tok_s, default=None), last


def fewest_experts_in_ram(n_layers: int, place: Callable[[int], Plan | None]) -> Plan | None:
    """The plan with the fewest layers' experts in RAM that fits (`place(n)`: the plan with the
    first n layers' experts in RAM, None when nothing fits). More experts in RAM leave the GPUs
    more room, so the search halves the range."""
    lo, hi, best = 1, n_layers, None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = place(mid)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    if best is None:
        return None
    note = (
        f"the GPUs cannot hold the whole model with its KV: the experts of layers 0-"
        f"{best.experts_in_ram - 1} stay in RAM ({best.expert_device}), as --n-cpu-moe "
        f"{best.experts_in_ram} would place them"
    )
    return replace(best, notes=(*best.notes, note))
