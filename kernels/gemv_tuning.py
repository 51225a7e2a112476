"""Per-architecture tuning tables of the Stream-K decode kernel (`streamk`).

A table is the JSON that benchmarks/gpu_gemv_suite.py writes on a device (its `winners.json`),
checked in as kernels/gemv_tuning_<arch>.json (arch: "sm_90" for an H200, "sm_89" an RTX 4090,
"sm_120" an RTX 5090, "sm_86" an RTX 3090): the fastest checked config per GGUF type and weight
shape [N, K], with the times it was chosen by.

    {"arch": "sm_90", "device": "NVIDIA H200", "copy_gbps": 4235.0, ...,
     "entries": [{"type": "Q4_K", "n": 4096, "k": 4096, "us": 6.1, "gbps": 1600.0,
                  "config": {"bn": 32, "step": 256, "ctas_per_sm": 8, "warps": 4,
                             "int_dot": true, "pdl": false}}, ...]}

An entry whose config is null says that qlinear's own decode kernel won there. A config of the
Gluon lanes kernel (`"lanes": CPL`) carries the entry's "fallback": the Triton config that
runs where Gluon cannot (Triton before 3.6, float32 activations, HETERO_GEMV_LANES=0).
`lookup` takes the entry of the same type and shape, else the same type's entry of the nearest
size (weight elements, on a log scale), else the architecture's default; None: qlinear's
kernel. A device without a table gets DEFAULT: a table is measured, never assumed from another
architecture.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from hetero.kernels.streamk import StreamKConfig

TABLE_DIR = Path(__file__).parent
# Without a table: a row a thread, 4 warps, 3 programs an SM (140 registers: 3 fit any SM of
# 64k registers); float32 activations take the float decode (streamk.choose).
DEFAULT = StreamKConfig(bn=128, warps=4, rows=True, ctas_per_sm=3)


@functools.cache
def arch_of(device: torch.device | str) -> str:
    """ "sm_<major><minor>" of a CUDA device; "cpu" elsewhere (the interpreter's tests). Asked
    by every eager quantized linear (its dispatch rules, its GEMV table): kept a device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def table_path(arch: str) -> Path:
    return TABLE_DIR / f"gemv_tuning_{arch}.json"


Entry = tuple[str, int, int, "StreamKConfig | None"]


@functools.cache
def load_table(arch: str) -> tuple[Entry, ...]:
    """(type, n, k, config) of every entry of the architecture's table (none without one)."""
    path = table_path(arch)
    if not path.is_file():
        return ()
    return parse_table(json.loads(path.read_text()))


def parse_table(table: dict) -> tuple[Entry, ...]:
    fields = set(StreamKConfig.__dataclass_fields__)
    out = []
    for e in table.get("entries", []):
        cfg = None
        if e.get("config") is not None:  # fields a newer table may add are ignored
            known = {k: v for k, v in e["config"].items() if k in fields and k != "fallback"}
            back = e.get("fallback")  # a Gluon config's Triton one
            if back is not None:
                known["fallback"] = StreamKConfig(**{k: v for k, v in back.items() if k in fields})
            cfg = StreamKConfig(**known)
        out.append((str(e["type"]), int(e["n"]), int(e["k"]), cfg))
    return tuple(out)


def pick(entries: tuple[Entry, ...], type_name: str, n: int, k: int) -> StreamKConfig | None:
    """The config for W [n, k] of `type_name` among `entries` (see the module docstring)."""
    same = [(en, ek, cfg) for t, en, ek, cfg in entries if t == type_name]
    for en, ek, cfg in same:
        if (en, ek) == (n, k):
            return cfg
    if not same:
        return DEFAULT
    size = math.log(n * k)
    return min(same, key=lambda e: abs(math.log(e[0] * e[1]) - size))[2]


def has_table(device: torch.device | str) -> bool:
    """Whether the device's architecture has a measured table (the registry picks the Stream-K
    kernel only there)."""
    return bool(load_table(arch_of(device)))


def lookup(device: torch.device | str, type_name: str, n: int, k: int) -> StreamKConfig | None:
    return pick(load_table(arch_of(device)), type_name, n, k)
