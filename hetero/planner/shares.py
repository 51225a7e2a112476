"""Shares of one GPU as devices: `cuda:0@70%:32GB` = 70% of the SMs (CUDA MPS's
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and at most 32 GB of its memory (a per-process cap).

Two shares of one card emulate two unequal cards where only one kind is at hand. A share's
profile is measured when `hetero profile --share SPEC` ran (under a started MPS daemon); else it
is derived from the whole GPU's profile:

- compute scales with the share: prefill TFLOP/s x s;
- memory bandwidth scales with sqrt(s): on the H200 with MPS, a 30% share copied at 2.55 TB/s
  and a 70% share at 3.84 TB/s (ratio 1.51 for shares 2.33 apart: exponent ln 1.51 / ln 2.33 =
  0.49), and both extrapolate to ~4.6 TB/s for the whole card, its measured copy rate. Fewer SMs
  keep fewer loads in flight, but each SM can pull more than its share of the bandwidth.
  (The measured compute was 274 and 585 TFLOP/s: 913 and 836 per unit share, close to linear.)
- host overheads do not scale (the host is not shared out).

A measured share also records the fraction of the card's bandwidth its decode kernels draw alone
(`with_bw_fraction`), which prices how shares of one card slow each other when their stages
overlap (setup.Setup.contention); a derived share uses sqrt(s) there too.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from hetero.planner.device import DeviceProfile

_SHARE = re.compile(
    r"^(?P<base>[a-z][a-z0-9_.-]*(?::\d+)?)@(?P<pct>\d+(?:\.\d+)?)%(?::(?P<mem>[\d.]+)GB)?$"
)
BANDWIDTH_EXPONENT = 0.5


@dataclass(frozen=True)
class Share:
    base: str  # "cuda:0"
    percent: float  # of the SMs, (0, 100]
    memory_cap: int  # bytes; 0: no cap

    @property
    def fraction(self) -> float:
        return self.percent / 100

    @property
    def id(self) -> str:
        mem = f":{self.memory_cap / 1e9:g}GB" if self.memory_cap else ""
        return f"{self.base}@{self.percent:g}%{mem}"


def is_share(spec: str) -> bool:
    return "@" in spec


def parse_share(spec: str) -> Share:
    """ "cuda:0@70%:32GB" -> Share; a "#k" suffix (the k-th of equal shares listed) is dropped."""
    m = _SHARE.match(re.sub(r"#\d+$", "", spec.strip()))
    if m is None:
        raise ValueError(f"device share {spec!r}: write DEVICE@PCT%[:MEMGB], e.g. cuda:0@70%:32GB")
    pct = float(m["pct"])
    if not 0 < pct <= 100:
        raise ValueError(f"device share {spec!r}: the SM share must be in (0, 100]%, got {pct}%")
    mem = int(float(m["mem"]) * 1e9) if m["mem"] else 0
    if m["mem"] and mem <= 0:
        raise ValueError(f"device share {spec!r}: the memory cap must be > 0 GB")
    return Share(m["base"], pct, mem)


def derive_share(base: DeviceProfile, share: Share) -> DeviceProfile:
    """The profile of `share` of `base`, scaled as the module doc says."""
    if base.is_cpu:
        raise ValueError(f"{share.id}: shares are of a GPU (CUDA MPS), not of a CPU")
    bw = bandwidth_fraction(share.fraction)
    fl = share.fraction
    if share.memory_cap > base.memory_total:
        raise ValueError(
            f"{share.id}: the memory cap {share.memory_cap / 1e9:.1f} GB is more than "
            f"{base.name}'s {base.memory_total / 1e9:.1f} GB"
        )
    matmul = {k: r.scaled(bw, fl) for k, r in base.matmul.items()}
    return base.replace(
        id=share.id,
        name=f"{base.name} ({share.fraction:.0%} of SMs)",
        mem_bw_gbs=base.mem_bw_gbs * bw,
        bf16_tflops=base.bf16_tflops * fl,
        attn_tflops=base.attn_tflops * fl,
        matmul=matmul,
        attn_gbs=base.attn_gbs * bw,
        sm_share=share.fraction,
        memory_cap=share.memory_cap,
        source="derived",
    )


def share_env(share: Share) -> dict[str, str]:
    """The environment a process serving `share` starts with (MPS reads it at CUDA init)."""
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{share.percent:g}"}


def bandwidth_fraction(fraction: float) -> float:
    """Fraction of the whole GPU's bandwidth a share of `fraction` of the SMs gets."""
    return math.pow(fraction, BANDWIDTH_EXPONENT)


def with_bw_fraction(share: DeviceProfile, machine: list[DeviceProfile]) -> DeviceProfile:
    """A measured share with its `bw_fraction`: the median over the quantized types of its T = 1
    rate over its whole GPU's in `machine` (unchanged when that GPU or the rates are missing).
    On the H200 the 70% and 30% shares read 0.785 and 0.408 of the card this way (the copy:
    0.92 and 0.61; sqrt(share): 0.84 and 0.55): overlapped, the planner prices them 1.19x
    slower than alone (setup.Setup.contention)."""
    base = next((p for p in machine if p.id == parse_share(share.id).base), None)
    if base is None:
        return share
    ratios = [
        r.decode_gbs / base.matmul[k].decode_gbs
        for k, r in share.matmul.items()
        if k.startswith("quant") and k in base.matmul and base.matmul[k].decode_gbs > 0
    ]
    return share.replace(bw_fraction=statistics.median(ratios)) if ratios else share
