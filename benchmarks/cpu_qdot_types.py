"""The qdot CPU kernel per GGUF block type: time per weight and GB/s of weight bytes read.

    python benchmarks/cpu_qdot_types.py [--types Q4_0,Q4_K,IQ4_NL,IQ4_XS,MXFP4] [--tokens 1,16]
        [--threads 2] [--variants avx512,avx2,generic] [--shape 4096x4096] [--rounds 7]

Each type's weight W [N, K] (random finite blocks) is copied until the copies hold 4x the
last-level cache, so every call reads its weights from memory, as a decode step's layers do.
x [T, K] float32 is quantized inside each call (qdot_linear, the model's entry point). Per
round every (variant, type, T) is timed once (the median of its calls over the copies), the
types taking turns so that a busy machine slows all of them alike; the table gives the median
over rounds, its spread (min-max), ns per weight (per token: the call's time / (N K T)), GB/s
of weight bytes and the time relative to Q4_0 and Q4_K at the same T. The 1-minute load average
is printed before and after: a figure taken above the core count is noise-bound.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch

from hetero.kernels import cpu_qdot, native
from hetero.profiler.measure import cpu_stream_bytes
from hetero.quant import get_quant, random_blocks

TYPES = ("Q4_0", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def copies(name: str, n: int, k: int, rotate: int) -> list[cpu_qdot.QdotWeight]:
    qt = get_quant(name)
    raw = random_blocks(name, n * k // qt.block_size, np.random.default_rng(0))
    first = cpu_qdot.pack(torch.from_numpy(raw).reshape(n, -1), qt, n, k)
    count = max(1, math.ceil(rotate / first.nbytes))
    return [first] + [cpu_qdot.QdotWeight(first.ggml_type, n, k, first.packed.clone())
                      for _ in range(count - 1)]  # fmt: skip


def seconds_per_call(ws, x: torch.Tensor, threads: int, variant: str, calls: int = 24) -> float:
    """Median over `calls` calls, each on the next copy (memory-resident weights)."""
    cpu_qdot.qdot_linear(x, ws[0], threads, variant)  # warm-up (and the library's first load)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        cpu_qdot.qdot_linear(x, ws[i % len(ws)], threads, variant)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(args) -> dict[tuple[str, str, int], list[float]]:
    n, k = (int(v) for v in args.shape.split("x"))
    rotate = cpu_stream_bytes(64 << 20)
    weights = {name: copies(name, n, k, rotate) for name in args.types}
    xs = {t: torch.randn(t, k) for t in args.tokens}
    runs: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for variant in args.variants:
            for t in args.tokens:
                for name in args.types:
                    sec = seconds_per_call(weights[name], xs[t], args.threads, variant)
                    runs.setdefault((variant, name, t), []).append(sec)
    return runs


def report(runs, args) -> None:
    n, k = (int(v) for v in args.shape.split("x"))
    print(f"{'isa':8} {'type':7} {'T':>3} {'us/call':>9} {'spread':>15} {'ns/w/tok':>9} "
          f"{'GB/s':>6} {'/Q4_0':>6} {'/Q4_K':>6}")  # fmt: skip
    med = {key: statistics.median(v) for key, v in runs.items()}
    for (variant, name, t), sec in med.items():
        qt = get_quant(name)
        wbytes = n * k * qt.type_size / qt.block_size
        lo, hi = min(runs[variant, name, t]), max(runs[variant, name, t])
        rel = [sec / med[variant, base, t] if (variant, base, t) in med else float("nan")
               for base in ("Q4_0", "Q4_K")]  # fmt: skip
        per_w, gbs = sec / (n * k * t) * 1e9, wbytes / sec / 1e9
        print(
            f"{variant:8} {name:7} {t:>3} {sec * 1e6:>9.0f} {lo * 1e6:>7.0f}-{hi * 1e6:<7.0f} "
            f"{per_w:>9.4f} {gbs:>6.2f} {rel[0]:>6.2f} {rel[1]:>6.2f}"
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(v for v in native.supported_variants()))
    p.add_argument("--shape", default="4096x4096", help="N x K")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    args.types = args.types.split(",")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.variants = args.variants.split(",")
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    for v in args.variants:
        print(f"{v}: {cpu_qdot.isa(v)}")
    runs = measure(args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    report(runs, args)


if __name__ == "__main__":
    main()
