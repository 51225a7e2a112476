"""CUDA devices: NVML enumeration by PCI bus id, and the measurements of one GPU.

NVML lists GPUs in PCI bus order; torch numbers them as CUDA_DEVICE_ORDER says (fastest first
by default) and after CUDA_VISIBLE_DEVICES. The two are joined on the GPU's UUID, never on the
index; profiles record the PCI bus id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

from hetero.kernels import ops, select
from hetero.planner.device import DeviceProfile, LiveDevice
from hetero.planner.shares import is_share, parse_share, share_env
from hetero.profiler.measure import (
    copy_gbs,
    gpu_matmul_rates,
    link_gbs,
    link_latency_s,
    matmul_tflops,
)

QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _bus(domain: int, bus: int, device: int) -> str:
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def _uuid(text: object) -> str:
    """NVML says "GPU-8f2c...", torch's properties give the bare UUID: compare the bare form."""
    t = text.decode() if isinstance(text, bytes) else str(text)
    return t.lower().removeprefix("gpu-")


def _torch_indices() -> dict[str, int]:
    """GPU UUID -> torch CUDA index (the same GPU whatever order each side lists them in)."""
    out: dict[str, int] = {}
    if not torch.cuda.is_available():
        return out
    for i in range(torch.cuda.device_count()):
        out[_uuid(torch.cuda.get_device_properties(i).uuid)] = i
    return out


def nvml_gpus() -> list[dict[str, Any]]:
    """Every GPU NVML sees that torch can use, in bus order, as LiveDevice fields."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVIDIA driver
        return []
    index = _torch_indices()
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        bus = _bus(pci.domain, pci.bus, pci.device)
        uuid = _uuid(pynvml.nvmlDeviceGetUUID(h))
        if uuid not in index:  # hidden by CUDA_VISIBLE_DEVICES
            continue
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        name = pynvml.nvmlDeviceGetName(h)
        gpus.append(
            dict(
                id=f"cuda:{index[uuid]}",
                kind="cuda",
                name=name.decode() if isinstance(name, bytes) else str(name),
                bus_id=bus,
                compute_capability=f"{major}.{minor}",
                memory_total=int(mem.total),
                memory_free=int(mem.free),
            )
        )
    return sorted(gpus, key=lambda g: g["bus_id"])


def measure_gpu(live: LiveDevice, gpus: list[LiveDevice], bar) -> DeviceProfile:
    """Copy and matmul ceilings, the qlinear kernel per GGUF type, host and peer links."""

    dev = torch.device(live.id)
    torch.cuda.set_device(dev)
    bar.set_postfix_str(f"{live.id}: copy, matmul")
    bw, fl = copy_gbs(dev, 1 << 30), matmul_tflops(dev, torch.bfloat16, 8192)
    bar.update(1)
    bar.set_postfix_str(f"{live.id}: quantized matmul x{len(QUANT_TYPES)} types")
    rates = gpu_matmul_rates(dev, QUANT_TYPES)
    bar.update(1)
    bar.set_postfix_str(f"{live.id}: links")
    cpu = torch.device("cpu")
    p2p = {
        g.id: link_gbs(dev, torch.device(g.id))
        for g in gpus
        if g.id != live.id and torch.cuda.can_device_access_peer(dev, torch.device(g.id))
    }
    h2d, d2h, lat = link_gbs(cpu, dev), link_gbs(dev, cpu), link_latency_s(dev)
    bar.update(1)
    torch.cuda.empty_cache()
    cc = tuple(int(x) for x in live.compute_capability.split("."))
    return live.profile(
        bw,
        fl,
        matmul=rates,
        h2d_gbs=h2d,
        d2h_gbs=d2h,
        link_latency_s=lat,
        p2p_gbs=p2p,
        fp8_kv=cc >= (8, 9),
        kernels={op: select(op, dev).name for op in ops()},
    )


def measure_gpu_subprocess(
    spec: str, timeout_s: float = 1800, progress: bool = True
) -> DeviceProfile:
    """Measure a GPU (`cuda:0`) or a share of one (`cuda:0@70%:24GB`) in a child process: a
    share's with the share's MPS environment, so the SM limit applies from CUDA's first call
    (needs a running MPS daemon); a whole GPU's so that the measurement leaves nothing in this
    process (share_worker.py). The child's progress shows on this process's stderr."""
    env = {**os.environ, **(share_env(parse_share(spec)) if is_share(spec) else {})}
    if not progress:
        env["TQDM_DISABLE"] = "1"  # tqdm reads its defaults from TQDM_* variables
    cmd = [sys.executable, "-m", "hetero.profiler.share_worker", spec]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"measuring {spec} failed (exit {done.returncode}): its error is printed above"
        )
    return DeviceProfile.from_dict(json.loads(lines[-1]))
