"""Device specs for dry runs: datasheet figures (configs/devices/*.toml) -> DeviceProfile.

`hetero plan --devices rtx5090,rtx4090` plans for cards this machine does not have. A datasheet
gives peaks; the planner needs achieved rates, so each peak is scaled by the fraction this project
measured on its own kernels (ACHIEVED, sources below). A TOML may override any of them in an
`[achieved]` table. A measured profile (`hetero profile`) needs none of this.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from hetero.planner.device import DeviceProfile, MatmulRate

# Achieved fractions of datasheet peaks, from BENCHMARKS.md (H200 unless said):
#   copy: device copy bandwidth / datasheet bandwidth (4.3 TB/s of 4.8 on a warm H200)
#   quant_decode: Triton GEMV weight GB/s / copy bandwidth at T = 1 (Q4_K on Llama-3-8B shapes:
#       39% for 4096x4096, 53% for 4096x14336, 78% for the output matrix; a layer is mostly the
#       large matrices)
#   dense_decode: bf16 weights through cuBLAS at T = 1, of copy bandwidth (a plain stream)
#   matmul: torch.mm bf16 8192^3 / datasheet dense peak (796 of 989 TFLOP/s)
#   prefill: dequantize + cuBLAS at T = 512 / the measured matmul rate (54-57%)
#   attention: KV bytes/s of the decode attention / copy bandwidth (torch reference path)
# The CPU rows come from the 2-core development machine (BENCHMARKS.md, cpu_linear): fbgemm fp16
# streams weights at ~60% of copy bandwidth at T = 1; fp32 MKL at ~80%; the qdot kernels (GGUF
# blocks times int8 activations, kernels/cpu_qdot.c) read at ~70% and multiply int8 at about
# twice the fp32 rate (AVX2 maddubs; VNNI does more).
ACHIEVED: dict[str, dict[str, float]] = {
    "cuda": dict(
        copy=0.9, quant_decode=0.5, dense_decode=0.8, matmul=0.8, prefill=0.55, attention=0.3
    ),
    "cpu": dict(
        copy=0.7,
        fp16_decode=0.6,
        qdot_decode=0.7,
        qdot_prefill=2.0,
        dense_decode=0.8,
        matmul=0.3,
        attention=0.15,
    ),
}
# Host overheads of an engine step (scheduler, metadata, launches, small ops). Eager steps
# (prefill; decode under --enforce-eager), from this project's engine on the H200: 40 tok/s for
# an 8B model at B = 1 eagerly, 25 ms a step over 32 layers, ~0.75 ms a layer of host launches.
# Decode replayed from CUDA graphs: the host launches one graph, the device runs the layer's
# ~15 kernels back to back (~1.5 us apart). The CPU (always eager): ~40 ms of 63 a step on the
# 2-core development machine; a desktop CPU is taken as ~2x faster for host work.
OVERHEADS: dict[str, dict[str, float]] = {
    "cuda": dict(step=1e-3, layer=2e-5, seq=1e-6, eager_step=5e-3, eager_layer=0.75e-3),
    "cpu": dict(step=3e-3, layer=0.6e-3, seq=5e-5, eager_step=3e-3, eager_layer=0.6e-3),
}
# A hand-off between pipeline stage processes (calibrate.py measures the host's): 1.0 ms on the
# H200 machine's 16-core host, 2-5 ms on the busy 2-core development machine.
PIPELINE_HOP_S = 1.5e-3
PCIE_GBS = {3: 16.0, 4: 32.0, 5: 64.0}  # per direction, x16, before protocol overhead
PCIE_ACHIEVED = 0.8
_REQUIRED = ("name", "kind", "memory_gib", "memory_bandwidth_gbs", "bf16_tflops")


def spec_dirs() -> list[Path]:
    """Where spec TOMLs live: the source tree's configs/devices, then the installed copy."""
    here = Path(__file__).resolve().parents[2] / "configs" / "devices"
    return [here, Path(sys.prefix) / "share" / "hetero" / "devices"]


def available() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in spec_dirs():
        for p in sorted(d.glob("*.toml")) if d.is_dir() else []:
            found.setdefault(p.stem, p)
    return found


def load_spec(name: str) -> DeviceProfile:
    """The DeviceProfile of spec `name` ("rtx4090") or of a TOML file path."""
    path = Path(name) if name.endswith(".toml") else available().get(name)
    if path is None or not path.is_file():
        known = ", ".join(available()) or "none found"
        raise ValueError(f"unknown device {name!r}: not present here and no spec; specs: {known}")
    with open(path, "rb") as f:
        spec = tomllib.load(f)
    return from_spec(path.stem, spec)


def from_spec(dev_id: str, spec: dict[str, Any]) -> DeviceProfile:
    missing = [k for k in _REQUIRED if k not in spec]
    if missing:
        raise ValueError(f"device spec {dev_id}: missing {', '.join(missing)}")
    kind = spec["kind"]
    if kind not in ACHIEVED:
        raise ValueError(f"device spec {dev_id}: kind {kind!r} is not one of cuda, cpu")
    ach = {**ACHIEVED[kind], **spec.get("achieved", {})}
    over = {**OVERHEADS[kind], **spec.get("overheads", {})}
    memory = int(spec["memory_gib"] * 2**30)
    copy = spec["memory_bandwidth_gbs"] * ach["copy"]
    flops = spec["bf16_tflops"] * ach["matmul"]
    link = PCIE_GBS.get(int(spec.get("pcie_gen", 4)), 32.0) * PCIE_ACHIEVED
    return DeviceProfile(
        id=dev_id,
        kind=kind,
        name=spec["name"],
        memory_total=memory,
        memory_free=memory if kind == "cuda" else int(memory * 0.8),  # an OS and apps on a CPU
        mem_bw_gbs=copy,
        bf16_tflops=flops,
        matmul=_matmul(kind, ach, copy, flops, spec),
        attn_gbs=copy * ach["attention"],
        h2d_gbs=0.0 if kind == "cpu" else link,
        d2h_gbs=0.0 if kind == "cpu" else link,
        link_latency_s=20e-6,
        pipeline_hop_s=PIPELINE_HOP_S,
        step_overhead_s=over["step"],
        layer_overhead_s=over["layer"],
        seq_overhead_s=over["seq"],
        eager_step_overhead_s=over["eager_step"],
        eager_layer_overhead_s=over["eager_layer"],
        compute_capability=str(spec.get("compute_capability", "")),
        fp8_kv=bool(spec.get("fp8", False)),
        kernels=_kernels(kind, str(spec.get("compute_capability", "0.0"))),
        source="datasheet",
    )


def _matmul(kind: str, ach: dict, copy: float, flops: float, spec: dict) -> dict[str, MatmulRate]:
    if kind == "cpu":
        return {
            "qdot": MatmulRate("cpu-qdot", copy * ach["qdot_decode"], flops * ach["qdot_prefill"]),
            "fp16": MatmulRate("fbgemm-fp16", copy * ach["fp16_decode"], flops),
            "dense": MatmulRate("torch", copy * ach["dense_decode"], flops),
        }
    major = int(str(spec.get("compute_capability", "0")).split(".")[0])
    rates = {"dense": MatmulRate("torch", copy * ach["dense_decode"], flops)}
    if major >= 8:  # the Triton kernels need bf16 tensor cores
        rates["quant"] = MatmulRate("triton", copy * ach["quant_decode"], flops * ach["prefill"])
    return rates


def _kernels(kind: str, cc: str) -> dict[str, str]:
    """The kernels the registry would pick: the Triton ones need CUDA compute capability 8.0
    (`triton_supported`), else the torch references."""
    major = int(cc.split(".")[0]) if cc else 0
    name = "triton" if kind == "cuda" and major >= 8 else "torch"
    return {"qlinear": name, "paged_attention": name, "kv_write": name}
