"""`hetero profile`: find this machine's devices, measure them once, cache the result.

GPUs are found through NVML (name, PCI bus id, memory, compute capability) and matched to torch's
device indices by bus id, so a profile of the 4090 is never given to the 5090 beside it whatever
order CUDA enumerates them in. The CPU is found through psutil. Measurements (planner/measure.py,
planner/calibrate.py) are cached per machine under the user's cache folder, keyed by a
fingerprint of the driver, the devices (names, bus ids, memory), the CPU and torch's version;
free memory is read live at every use.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from hetero.kernels import cpu_threads, ops, select
from hetero.planner.device import DeviceProfile, LiveDevice
from hetero.profiler.calibrate import calibrate
from hetero.profiler.gpu import measure_gpu_subprocess, nvml_gpus
from hetero.profiler.measure import (
    copy_gbs,
    cpu_matmul_rates,
    cpu_prefill_attention_tflops,
    cpu_stream_bytes,
    matmul_tflops,
)

# 2: matmul curves over T, eager overheads; 3: CPU qdot rates, GPU decode rates from graph replays;
# 4: a sequence's overhead once a step apart from its per-layer one; 5: CPU rates streamed past the
# last-level cache, qdot on Q8 blocks apart; 6: the pipeline hop; 7: qdot reads K-quants as they
# are (rates per type: Q4_1, Q8_0, Q4_K, Q6_K); 8: qdot on the codebook types too (IQ4_NL, IQ4_XS,
# MXFP4), which an older profile priced at Q4_1's rate; 9: K-quant prompts on AMX tiles where the
# CPU has them (kernels/cpu_qdot_amx.h), several times the rate an older profile measured
# 10: CPU rates on a 28672 x 4096 matrix and at T = 1 on a 4096 x 1024 one too (MatmulRate.sizes)
# and the CPU's prompt attention timed on its own (DeviceProfile.attn_tflops)
CACHE_VERSION = 11


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def live_devices() -> list[LiveDevice]:
    """GPUs in PCI bus order, then the CPU."""
    vm = psutil.virtual_memory()
    cpu = LiveDevice("cpu", "cpu", cpu_name(), "", "", int(vm.total), int(vm.available))
    return [LiveDevice(**g) for g in nvml_gpus()] + [cpu]


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # no NVIDIA driver: a CPU-only machine
        return ""


def fingerprint(devices: list[LiveDevice]) -> str:
    key = {
        "driver": driver_version(),
        "devices": [(d.id, d.name, d.bus_id, d.memory_total) for d in devices],
        "cpu_threads": cpu_threads.planned(),
        "torch": torch.__version__,
        "version": CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hetero" / "profiles"


def measure_cpu(live: LiveDevice, bar: tqdm) -> DeviceProfile:
    cpu = torch.device("cpu")
    threads = cpu_threads.ensure()  # measured as the engine will run: the cache key's count
    bar.set_postfix_str("cpu: copy, matmul")
    bw, fl = copy_gbs(cpu, cpu_stream_bytes(128 << 20)), matmul_tflops(cpu, torch.float32, 512)
    bar.update(1)
    bar.set_postfix_str("cpu: linear kernels")
    rates = cpu_matmul_rates()
    bar.update(1)
    prof = live.profile(
        bw,
        fl,
        name=f"{live.name} ({threads} threads)",
        matmul=rates,
        fp8_kv=False,  # no e4m3 hardware: "auto" KV is fp16 here, as the engine picks
        kernels={op: select(op, cpu).name for op in ops()},
    ).replace(attn_tflops=cpu_prefill_attention_tflops())
    return _calibrated(prof, "cpu", "fp16", bar)


def _calibrated(prof: DeviceProfile, device: str, kv_dtype: str, bar: tqdm) -> DeviceProfile:
    bar.set_postfix_str(f"{device}: engine overheads")
    return prof.replace(**calibrate(prof, device, kv_dtype, bar))


def busy_warning(load: float, cores: int) -> str | None:
    """The warning for a profile measured while other work kept the CPU busy (its rates, and
    the host overheads every device's plan uses, read low and are cached)."""
    if load <= max(1.0, cores / 2):
        return None
    return (
        f"warning: the machine was busy while profiling (load average {load:.1f} on {cores} "
        "cores); the rates may read low. Run `hetero profile --refresh` on a quiet machine."
    )


def measure(devices: list[LiveDevice], progress: bool = True) -> list[DeviceProfile]:
    load_before = os.getloadavg()[0]
    out = _measure(devices, progress)
    warning = busy_warning(min(load_before, os.getloadavg()[0]), os.cpu_count() or 1)
    if warning:
        tqdm.write(warning, file=sys.stderr)
    return out


def _measure(devices: list[LiveDevice], progress: bool) -> list[DeviceProfile]:
    steps = 5 * len(devices)
    with tqdm(total=steps, desc="profiling", unit="step", disable=not progress) as bar:
        out = []
        for d in devices:
            if d.kind == "cpu":
                out.append(measure_cpu(d, bar))
            else:  # in a child process: nothing of it stays in this one (share_worker.py)
                bar.set_postfix_str(f"{d.id}: in a child process")
                out.append(measure_gpu_subprocess(d.id, progress=progress))
                bar.update(5)
    hop = host_hop_s(out)
    return [p if p.is_cpu else p.replace(pipeline_hop_s=hop) for p in out]


def host_hop_s(profiles: list[DeviceProfile]) -> float:
    """The hand-off between stage processes: the host's, measured with the CPU's overheads (a
    GPU's profile, or a GPU share's, takes it from there)."""
    return next((p.pipeline_hop_s for p in profiles if p.is_cpu), 0.0)


def load_cached(fp: str) -> dict | None:
    return _read(cache_dir() / f"{fp}.json")


def _read(path: Path) -> dict | None:
    """A cached profile document, its profiles parsed; None when absent or unreadable."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        doc["devices"] = [DeviceProfile.from_dict(d) for d in doc["devices"]]
        doc["shares"] = {k: DeviceProfile.from_dict(v) for k, v in doc.get("shares", {}).items()}
        return doc
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a cache from another version, or damaged: measure again


def save(fp: str, devices: list[DeviceProfile], shares: dict[str, DeviceProfile]) -> Path:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "fingerprint": fp,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "devices": [d.to_dict() for d in devices],
        "shares": {k: v.to_dict() for k, v in shares.items()},
    }
    path = folder / f"{fp}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    return path


def machine_profiles(
    refresh: bool = False, progress: bool = True, only: Sequence[str] = ()
) -> list[DeviceProfile]:
    """Profiles of the devices present now: cached when the fingerprint matches, else measured.
    With `refresh` and `only` (device ids, e.g. ["cpu"]), only those devices are measured again
    and the others keep their cached profiles (all are measured when the cache lacks one).
    Free memory is always the live value."""
    live = live_devices()
    unknown = sorted(set(only) - {d.id for d in live})
    if unknown:
        raise ValueError(
            f"no device {', '.join(unknown)} here to profile again "
            f"(present: {', '.join(d.id for d in live)})"
        )
    fp = fingerprint(live)
    old = load_cached(fp)
    cached = None if refresh else old
    if cached is not None and [p.id for p in cached["devices"]] != [d.id for d in live]:
        cached = None  # not these devices (a hand-edited or damaged cache): measure again
    if cached is None:
        kept = {p.id: p for p in old["devices"]} if (old and refresh and only) else {}
        fresh = {
            p.id: p
            for p in measure([d for d in live if d.id in only or d.id not in kept], progress)
        }
        merged = [fresh.get(d.id) or kept[d.id] for d in live]
        hop = host_hop_s(merged)  # the host's hand-off, measured with the CPU, for every GPU
        profiles = [p if p.is_cpu else p.replace(pipeline_hop_s=hop) for p in merged]
        save(fp, profiles, old["shares"] if old else {})
    else:
        profiles = cached["devices"]
    free = {d.id: d.memory_free for d in live}
    return [p.replace(memory_free=free.get(p.id, p.memory_free)) for p in profiles]


def cached_shares() -> dict[str, DeviceProfile]:
    doc = load_cached(fingerprint(live_devices()))
    return {} if doc is None else doc["shares"]


def profiled_elsewhere(dev_id: str) -> DeviceProfile | None:
    """A device of that id in a cached profile of another configuration of this machine: a
    device that was here when that profile was made and is gone now."""
    folder = cache_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        doc = _read(path)
        for d in doc["devices"] if doc is not None else []:
            if d.id == dev_id:
                return d
    return None


class ThisMachine:
    """The planner's view of this machine (planner/resolve.py's Machine): its devices now, their
    profiles measured on first use (or read from the cache), measured GPU shares."""

    def __init__(self, refresh: bool = False, progress: bool = True, only: Sequence[str] = ()):
        self.refresh, self.progress, self.only = refresh, progress, tuple(only)
        self._profiles: list[DeviceProfile] | None = None

    @property
    def profiles(self) -> list[DeviceProfile]:
        if self._profiles is None:
            self._profiles = machine_profiles(self.refresh, self.progress, self.only)
        return self._profiles

    @property
    def present(self) -> list[str]:
        return [d.id for d in live_devices()]

    def shares(self) -> dict[str, DeviceProfile]:
        return cached_shares()

    def profiled_elsewhere(self, dev_id: str) -> DeviceProfile | None:
        return profiled_elsewhere(dev_id)
