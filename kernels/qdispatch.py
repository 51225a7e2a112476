"""Which quantized-matmul kernel `qlinear` runs, by GGUF type x token count x shape class.

The default paths (`triton_qmatmul`: decode kernel for T <= 2, tensor cores below DENSE_MIN_T,
dequantize + cuBLAS above) are right for most cells; the rules below are the cells where
benchmarks/gpu_qsweep.py found another kernel faster by >= 10% (timing noise between two runs
of one config was ~4%). The sweep: H200, Triton 3.6, torch 2.11, 2026-11-29, Llama-3-8B shapes,
bf16 activations, timed from CUDA-graph replays over weights rotated through L2; copy bandwidth
2714 GB/s. Figures are us per call, winner vs the default path:

    Q8_0  T <= 2   all shapes  gemv_pipe bn16 c8   T=1 gate/up 28.4 vs 36.0, down 28.5 vs 35.4,
                                                    q/o 11.0 vs 12.7, lm_head 186 vs 245;
                                                    T=2 gate/up 47.9 vs 63.8, q/o 16.3 vs 19.6
    Q4_K  T = 2    large       gemv bn64 c8        gate/up 33.5 vs 37.5
    Q5_K  T = 1    large       gemv bn64 c8        gate/up 30.8 vs 34.7
    Q5_K, Q6_K  T = 2  mid, large   mm (tensor cores)   down 44.3 vs 59.7 (Q5_K), 53.5 vs 69.9
                                                    (Q6_K); q/o 16.6 vs 19.4, 19.3 vs 22.4
    any   T = 3-4  small       tokens bn32 c4      k/v 7.0 vs 9.6 (Q4_K), 7.9 vs 10.1 (Q5_K),
                                                    8.6 vs 10.9 (Q6_K); Q8_0 bn16: 8.0 vs 10.6
    Q4_K, Q6_K  T = 5-8  small  tokens bn32 c4     k/v T=8 8.7 vs 9.8, 10.2 vs 11.3
    any   T = 33-159  small    dense               k/v T=64 10.4 vs 15.2 (Q4_K), 10.5 vs 15.4,
                                                    10.7 vs 16.2, 10.4 vs 16.6 (Q8_0)
    Q4_K  T = 33-64   large    mm_pipe bn64 k256   (2026-11-30 sweep, copy 4261 GB/s by events)
                                                    fused gate|up T=64 91.8 vs 104.5, down 56.0
                                                    vs 62.4; q|k and q/o (mid): no gain

Rules may name the architectures they were measured on (`archs`; none: every one). sm_90 only,
from the 2026-12-06 sweep on an H100 (copy 3006 GB/s by events; gpu_qsweep.py --tokens 64,
--kernels auto,dense,gmm,gmmw), the Gluon dense kernel on Hopper's warpgroup MMA against what
ran before (the mm_pipe rule for Q4_K large, the default path for the rest):

    Q4_K  T = 33-64  large  gmmw bn64 bt64 k128 c2 st2  fused gate|up T=64 60.9 vs 92.5, down
                                                    41.1 vs 56.7
    Q4_K  T = 33-64  mid    the same                fused q|k 19.4 vs 23.2, q/o 16.8 vs 19.3
    Q6_K  T = 33-64  large  the same                gate|up 70.0 vs 217.6, down 46.5 vs 107.8
    Q6_K  T = 33-64  mid    the same                q|k 21.3 vs 43.7, q/o 18.0 vs 34.8

(the mma.sync form, `gmm`, which runs on sm_80 and later, also beat the old paths there: e.g. Q4_K
gate|up 77.9, Q6_K down 53.5; other architectures keep the old rules until a sweep on them.)

At T >= 160 (DENSE_MIN_T) the default path is dequantize + cuBLAS already, which the sweep
confirmed at T = 512 on every shape (within 1% of the best candidate).

Shape classes by weight elements N x K: small < 12M (k/v 1024 x 4096, fused k+v), mid < 32M
(q/o 4096 x 4096, fused q+k+v 6144 x 4096), large (gate/up, down, fused gate+up, lm_head).
The fused shapes were not in the sweep: they take their class's rules until measured.

HETERO_QDISPATCH=rules.json puts rules from a file before these (`extra_rules`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from hetero.kernels.triton_qvariants import Variant, parse

SMALL_MAX = 12 << 20  # weight elements
MID_MAX = 32 << 20


def shape_class(n: int, k: int) -> str:
    size = n * k
    return "small" if size < SMALL_MAX else "mid" if size < MID_MAX else "large"


@dataclass(frozen=True)
class Rule:
    types: tuple[str, ...]  # GGUF type names; () matches every type
    shapes: tuple[str, ...]  # shape classes
    t_min: int
    t_max: int
    kernel: Variant | str  # a sweep variant, "mm" (qmm's own config) or "dense"
    archs: tuple[str, ...] = ()  # "sm_90" ... (gemv_tuning.arch_of); (): every architecture


_ALL = ("small", "mid", "large")
_GMMW = Variant("gmmw", bn=64, bt=64, step=128, ctas=2, stages=2)
RULES: tuple[Rule, ...] = (
    Rule(("Q4_K", "Q6_K"), ("mid", "large"), 33, 64, _GMMW, ("sm_90",)),
    Rule(("Q8_0",), _ALL, 1, 2, Variant("gemv_pipe", bn=16, ctas=8)),
    Rule(("Q4_K",), ("large",), 2, 2, Variant("gemv", bn=64, ctas=8)),
    Rule(("Q5_K",), ("large",), 1, 1, Variant("gemv", bn=64, ctas=8)),
    Rule(("Q5_K", "Q6_K"), ("mid", "large"), 2, 2, "mm"),
    Rule(("Q8_0",), ("small",), 3, 4, Variant("tokens", bn=16, ctas=4)),
    Rule((), ("small",), 3, 4, Variant("tokens", bn=32, ctas=4)),
    Rule(("Q4_K", "Q6_K"), ("small",), 5, 8, Variant("tokens", bn=32, ctas=4)),
    Rule((), ("small",), 33, 159, "dense"),
    Rule(("Q4_K",), ("large",), 33, 64, Variant("mm_pipe", bn=64, bt=64, step=256, stages=3)),
)


@functools.cache
def extra_rules(path: str | None = None) -> tuple[Rule, ...]:
    """Rules read from a JSON file (HETERO_QDISPATCH, or `path`), tried before RULES: a list of
    {"types": [...], "shapes": [...], "t_min": int, "t_max": int, "kernel": a Variant's name,
    "mm" or "dense", "archs": [...] (optional)}, as benchmarks/qsweep_rules.py writes them from
    a sweep on this machine (so a sweep's winners can be run before they are written into
    RULES)."""
    path = path or os.environ.get("HETERO_QDISPATCH")
    if not path:
        return ()
    with open(path) as f:
        entries = json.load(f)
    rules = []
    for e in entries:
        shapes = tuple(e["shapes"])
        if not set(shapes) <= set(_ALL):
            raise ValueError(f"{path}: shape classes {shapes} not among {_ALL}")
        kernel = e["kernel"] if e["kernel"] in ("mm", "dense") else parse(e["kernel"])
        span, archs = (int(e["t_min"]), int(e["t_max"])), tuple(e.get("archs", ()))
        rules.append(Rule(tuple(e["types"]), shapes, *span, kernel, archs))
    return tuple(rules)


def choose(type_name: str, n: int, k: int, t: int, arch: str = "") -> Variant | str | None:
    """The first rule's kernel for W [n, k] of `type_name` at T = t on architecture `arch`
    (HETERO_QDISPATCH's rules first); None: the default path."""
    cls = shape_class(n, k)
    for r in (*extra_rules(), *RULES):
        if r.t_min <= t <= r.t_max and cls in r.shapes and (not r.types or type_name in r.types):
            if not r.archs or arch in r.archs:
                return r.kernel
    return None
