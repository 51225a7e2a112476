"""`--devices` names -> DeviceProfiles: devices of this machine, datasheet specs, GPU shares.

    cuda:0, cpu                  measured here (profiled once, cached)
    rtx4090, h200, desktop-ddr5  configs/devices/<name>.toml (a dry run)
    cuda:0@70%:32GB, h200@30%    a share of a GPU (measured with `hetero profile --share`, or
                                 derived from the whole device's profile)

The machine is measured only when a name refers to it, so a dry run over specs measures nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from hetero.config import device_key
from hetero.planner.device import DeviceProfile
from hetero.planner.plan import PlanError
from hetero.planner.shares import derive_share, is_share, parse_share
from hetero.planner.specs import load_spec


class Machine(Protocol):
    """This machine's devices, as the profiler knows them (profiler/machine.py: ThisMachine)."""

    @property
    def profiles(self) -> list[DeviceProfile]:
        """Measured profiles of the devices present (measured on first use, then cached)."""

    @property
    def present(self) -> list[str]:
        """Ids of the devices here now (enumerated, not measured)."""

    def shares(self) -> dict[str, DeviceProfile]:
        """Measured shares of its GPUs (`hetero profile --share`), by share id."""

    def profiled_elsewhere(self, dev_id: str) -> DeviceProfile | None:
        """A device of that id in a cached profile of another configuration of this machine."""


def _get(machine: Machine | None, dev_id: str) -> DeviceProfile | None:
    if dev_id not in _machine(machine, dev_id).present:
        return None
    return next((p for p in machine.profiles if p.id == dev_id), None)


def _machine(machine: Machine | None, name: str) -> Machine:
    if machine is None:
        raise PlanError(f"{name} is a device of this machine: planning for it needs its profile")
    return machine


def _is_machine_name(name: str) -> bool:
    return name == "cpu" or name.startswith("cuda")


def _machine_device(machine: Machine | None, name: str) -> DeviceProfile:
    name = device_key(name)
    found = _get(machine, name)
    if found is not None:
        return found
    gone = machine.profiled_elsewhere(name)
    present = ", ".join(machine.present)
    if gone is not None:
        raise PlanError(
            f"{name} ({gone.name}, bus {gone.bus_id or '-'}) was profiled on this machine but is "
            f"not present now (present: {present}); check the card, or plan without it"
        )
    raise PlanError(f"no device {name} on this machine (present: {present})")


def _base(machine: Machine | None, name: str) -> DeviceProfile:
    if _is_machine_name(name):
        return _machine_device(machine, name)
    return load_spec(name)


def _share(machine: Machine | None, name: str) -> DeviceProfile:
    share = parse_share(name)
    if _is_machine_name(share.base):
        measured = _machine(machine, name).shares().get(share.id)
        if measured is not None:
            free = _machine_device(machine, share.base).memory_free
            return measured.replace(memory_free=free)
    return derive_share(_base(machine, share.base), share)


def resolve_devices(names: list[str] | None, machine: Machine | None = None) -> list[DeviceProfile]:
    """Profiles for `names` in the order given (None: every device of `machine`). Datasheet
    specs and their shares need no machine: a dry run over them measures nothing."""
    if not names:
        return _machine(machine, "every device").profiles
    out = []
    for name in names:
        name = name.strip()
        if not name:
            raise PlanError("--devices has an empty entry")
        out.append(_share(machine, name) if is_share(name) else _base(machine, name))
    _check_shares(out)
    return _split_shared_memory(_unique(out))


def _check_shares(profiles: list[DeviceProfile]) -> None:
    """Shares of one GPU stand for separate cards: together they cannot take more than its SMs
    or its memory."""
    by_base: dict[str, list[DeviceProfile]] = {}
    for p in profiles:
        if is_share(p.id):
            by_base.setdefault(parse_share(p.id).base, []).append(p)
    for base, mine in by_base.items():
        names = ", ".join(p.id for p in mine)
        pct = sum(p.sm_share for p in mine) * 100
        if pct > 100 + 1e-6:
            raise PlanError(f"the shares of {base} ({names}) take {pct:g}% of its SMs: at most 100")
        caps, total = sum(p.memory_cap for p in mine), mine[0].memory_total
        if caps > total:
            raise PlanError(
                f"the memory caps of {base}'s shares ({names}) add up to {caps / 1e9:.1f} GB, "
                f"more than its {total / 1e9:.1f} GB"
            )


def _split_shared_memory(profiles: list[DeviceProfile]) -> list[DeviceProfile]:
    """Shares of one GPU without a memory cap divide what the capped ones leave of its free
    memory, as the stages that run them do (each sizes its KV pool from its share)."""
    shares = [parse_share(p.id) if is_share(p.id) else None for p in profiles]
    out = list(profiles)
    for base in {s.base for s in shares if s is not None}:
        mine = [i for i, s in enumerate(shares) if s is not None and s.base == base]
        open_ = [i for i in mine if not profiles[i].memory_cap]
        if len(mine) < 2 or not open_:
            continue
        capped = sum(profiles[i].memory_cap for i in mine if profiles[i].memory_cap)
        left = max(0, profiles[open_[0]].memory_free - capped)
        for i in open_:
            out[i] = profiles[i].replace(memory_free=left // len(open_))
    return out


def _unique(profiles: list[DeviceProfile]) -> list[DeviceProfile]:
    """Two cards of one spec ("rtx3090,rtx3090") become rtx3090 and rtx3090#2. A device of this
    machine listed k times ("cpu,cpu": a pipeline of two processes on one CPU) becomes cpu and
    cpu#2, both run on cpu (StagePlan.base_device), each with 1/k of its memory and its share of
    the compute (`shared_by`); the plan notes that they share it."""
    total = Counter(p.id for p in profiles)
    seen: Counter[str] = Counter()
    out = []
    for p in profiles:
        seen[p.id] += 1
        k = total[p.id]
        if k > 1 and p.source != "datasheet" and not is_share(p.id):  # a share is its own slice
            p = shared_by(p, k)
        out.append(p if seen[p.id] == 1 else p.replace(id=f"{p.id}#{seen[p.id]}"))
    return out


def shared_by(p: DeviceProfile, k: int) -> DeviceProfile:
    """One of k stage processes on device p: 1/k of its memory; on a CPU the pipeline gives each
    of the k processes threads // k of the threads the profile was measured with, on a GPU the k
    processes take turns (no MPS). Rates scale by that share; host overheads do not."""
    from hetero.kernels import cpu_threads

    threads = cpu_threads.planned()
    f = max(1, threads // k) / threads if p.is_cpu else 1.0 / k
    matmul = {key: r.scaled(f, f) for key, r in p.matmul.items()}
    return p.replace(
        memory_free=p.memory_free // k,
        memory_cap=p.memory_cap // k,
        mem_bw_gbs=p.mem_bw_gbs * f,
        bf16_tflops=p.bf16_tflops * f,
        attn_tflops=p.attn_tflops * f,
        attn_gbs=p.attn_gbs * f,
        matmul=matmul,
    )
