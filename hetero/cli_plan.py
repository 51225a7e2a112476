"""What `hetero profile` and `hetero plan` do (cli.py only declares their options): this
machine's devices measured by the profiler, planned by the planner."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import click

from hetero.config import device_key
from hetero.factory import LaunchConfig
from hetero.models import resolve_model
from hetero.planner.drawing import svg_of_plan
from hetero.planner.model_desc import describe
from hetero.planner.plan import Plan, PlanConfig, PlanError, plan
from hetero.planner.report import format_plan, format_profiles
from hetero.planner.resolve import resolve_devices
from hetero.planner.shares import parse_share, with_bw_fraction
from hetero.profiler.gpu import measure_gpu_subprocess
from hetero.profiler.machine import (
    ThisMachine,
    cached_shares,
    fingerprint,
    host_hop_s,
    live_devices,
    load_cached,
    machine_profiles,
    save,
)


def run_profile(
    refresh: bool, shares: tuple[str, ...], as_json: bool, only: tuple[str, ...] = ()
) -> None:
    gpus = [d.id for d in live_devices() if d.kind == "cuda"]
    for spec in shares:
        _check_share_here(spec, gpus)
    profiles = machine_profiles(refresh=refresh, progress=not as_json, only=only)
    measured = dict(cached_shares())
    for spec in shares:
        prof = measure_gpu_subprocess(spec).replace(pipeline_hop_s=host_hop_s(profiles))
        prof = with_bw_fraction(prof, profiles)
        measured[prof.id] = prof
    if shares:
        fp = fingerprint(live_devices())
        doc = load_cached(fp)
        save(fp, doc["devices"] if doc else profiles, measured)
    everything = profiles + list(measured.values())
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in everything], indent=1))
    else:
        click.echo(format_profiles(everything))


def _check_share_here(spec: str, gpus: list[str]) -> None:
    """--share measures a share of a GPU of this machine: refuse anything else before starting."""
    base = device_key(parse_share(spec).base)
    if base == "cpu":
        raise PlanError(f"--share {spec}: shares are of a GPU (CUDA MPS), not of the CPU")
    if base not in gpus:
        what = "a GPU of this machine" if base.startswith("cuda") else "a device of this machine"
        raise PlanError(
            f"--share {spec}: {base} is not {what} (GPUs here: {', '.join(gpus) or 'none'}); "
            "a datasheet card's share is planned without measuring, e.g. --devices h200@70%"
        )


def plan_config(**opts) -> PlanConfig:
    """Flat options (as on the command line) -> a PlanConfig: its own fields, and the rest read
    as the engine reads them (LaunchConfig.from_options) into its engine config and weights."""
    opts = {k: v for k, v in opts.items() if v is not None}
    own = {f.name for f in fields(PlanConfig)} - {"engine", "weights", "offload_min_tokens"}
    plan_opts = {k: opts.pop(k) for k in list(opts) if k in own}
    launch = LaunchConfig.from_options(**opts)
    rt = launch.runtime
    return PlanConfig(
        **plan_opts,
        engine=launch.engine,
        weights=rt.weights,
        offload_min_tokens=rt.offload_min_tokens,
    )


def in_one_process(profiles) -> bool:
    """Whether the engine runs these devices in one process (the local executor's segments: one
    GPU, then the CPU) rather than as pipeline stages (several GPUs, or a device listed twice)."""
    gpus = [p for p in profiles if not p.is_cpu]
    return len(gpus) <= 1 and len({p.id.split("#")[0] for p in profiles}) == len(profiles)


def run_plan(
    model: str | None,
    devices: str | None,
    refresh: bool,
    as_json: bool,
    output: str | None,
    pipeline: bool = False,
    **config_opts,
) -> Plan:
    target = model if model and model.startswith("synth:") else str(resolve_model(model))
    desc = describe(target)
    names = [n for n in devices.split(",")] if devices else None
    profiles = resolve_devices(names, ThisMachine(refresh, progress=not as_json))
    in_process = not pipeline and in_one_process(profiles)
    result = plan(desc, profiles, plan_config(**config_opts, in_process=in_process))
    if output and Path(output).suffix.lower() == ".svg":
        Path(output).write_text(svg_of_plan(result))  # the picture the status page draws
    elif output:
        Path(output).write_text(result.to_json() + "\n")
    click.echo(result.to_json() if as_json else format_plan(result))
    return result


__all__ = ["PlanError", "run_plan", "run_profile"]
