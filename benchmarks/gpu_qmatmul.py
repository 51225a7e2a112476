"""Triton quantized matmul on the GPU: time per call against the device's measured ceilings.

    python benchmarks/gpu_qmatmul.py [--types Q4_K,Q6_K] [--shapes all] [--json OUT.json]

1. Ceilings, measured in the same run: device-to-device copy bandwidth (a 4 GiB copy, bytes read
   plus written) and the bf16 matmul rate (torch.mm, 8192^3, random data).
2. Llama-3-8B linear shapes (K x N: 4096x4096 q/o, 4096x1024 k/v, 4096x14336 gate/up,
   14336x4096 down, 4096x128256 output) per GGUF type, random blocks:
   - T = 1 (decode kernel): us per call, GB/s of weight bytes read and the fraction of the copy
     bandwidth. Small matrices fit in the 50 MB L2, so calls rotate over copies of the weight
     (>= 256 MB in all) as a model's layers would; calls are replayed from a CUDA graph, so
     the numbers are device time, not Python launch overhead.
   - T = 512: the dense path (dequantize + cuBLAS) and the fused tensor-core kernel: us per call,
     TFLOP/s and the fraction of the bf16 matmul rate.
3. The decode / tensor-core / dense crossover over T for one type and shape (sets GEMV_MAX_T and
   DENSE_MIN_T in hetero.kernels.triton_qmatmul).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.repack import SPECS, PackedWeight, repack
from hetero.quant import get_quant, random_blocks

SHAPES = {  # name -> (K, N): y [T, N] = x [T, K] @ W^T
    "q/o 4096x4096": (4096, 4096),
    "k/v 4096x1024": (4096, 1024),
    "gate/up 4096x14336": (4096, 14336),
    "down 14336x4096": (14336, 4096),
    "output 4096x128256": (4096, 128256),
}
DEFAULT_TYPES = "Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K"
ROTATE_BYTES = 256 << 20  # weights touched per replay: 5x the L2


def _warm_type(ggml_type: str, tokens: list[int], block_ns: list[int]) -> str:
    """Compile one type's kernels (the variants the run will launch) in a worker process."""
    pw, _ = make_packed(ggml_type, 256, 4096, seed=0)
    for t in tokens:
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        tq.qmm(x, pw)
        if t <= 8:
            for block_n in block_ns or [None]:
                tq.qgemv(x, pw, block_n=block_n)
    tq.dense_mm(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), pw)
    torch.cuda.synchronize()
    return ggml_type


def warm_up(jobs: dict[str, tuple[list[int], list[int]]]) -> None:
    """Triton compiles in the launching thread, one kernel at a time; compiling every type's
    variants in parallel processes (into the shared on-disk cache) first saves minutes."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(12, len(jobs)), mp_context=ctx) as pool:
        for done in pool.map(_warm_type, *zip(*((t, *j) for t, j in jobs.items()))):
            print("compiled", done, flush=True)


def graph_time(fns: list[Callable[[], object]], replays: int) -> float:
    """Seconds per call of fns (run in turn), from CUDA-graph replays timed with events."""
    for fn in fns:  # compile, allocate workspaces and counters outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return float(np.median(event_times(graph.replay, replays))) / len(fns)


def copy_pair(nbytes: int = 4 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) float32 of nbytes each, after a second of copies between them (an idle GPU
    clocks down; the first round measured 35% low)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    end = time.time() + 1.0
    while time.time() < end:
        dst.copy_(src)
        torch.cuda.synchronize()
    return src, dst


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy, read + write bytes: the best of 10 copies timed
    with events (copy_pair warms the GPU first). Not from a graph replay: a copy captured in a
    CUDA graph runs as a memcpy node, which read 2712 GB/s where the same copy launched from the
    stream read 4235 (and a read-only reduction 4387) in one run on the H200
    (benchmarks/gpu_step_profile.py)."""
    src, dst = copy_pair()
    return 2 * src.nbytes / event_time(lambda: dst.copy_(src), 10) / 1e9


def event_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of `reps` calls of fn, timed with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def event_time(fn: Callable[[], object], reps: int) -> float:
    """The shortest of `reps` calls of fn, in seconds, timed with CUDA events (no graph)."""
    return min(event_times(fn, reps))


def matmul_rate() -> float:
    """TFLOP/s of torch.mm on random 8192^3 bf16."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    sec = graph_time([lambda: torch.mm(a, b)], 10)
    return 2 * n**3 / sec / 1e12


@functools.lru_cache(maxsize=2)
def _random_blocks(ggml_type: str, count: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(ggml_type, count, np.random.default_rng(seed)))


def make_packed(
    ggml_type: str, n: int, k: int, seed: int, high_layout: str = "fields"
) -> tuple[PackedWeight, int]:
    """A packed random weight on the GPU and its GGUF size in bytes. Random blocks are drawn
    for up to 2^20 blocks on the CPU and tiled: the bytes, not their values, set the timing."""
    qt = get_quant(ggml_type)
    n_blocks = n * k // qt.block_size
    drawn = min(n_blocks, 1 << 20)
    blocks = _random_blocks(ggml_type, drawn, seed).cuda()
    blocks = blocks.repeat(math.ceil(n_blocks / drawn), 1)[:n_blocks]
    pw = repack(blocks.reshape(n, -1), ggml_type, (n, k), high_layout=high_layout)
    return pw, n_blocks * qt.type_size


def rotated(
    ggml_type: str, n: int, k: int, high_layout: str = "fields"
) -> tuple[list[PackedWeight], int]:
    first, gguf_bytes = make_packed(ggml_type, n, k, seed=0, high_layout=high_layout)
    copies = max(1, min(128, ROTATE_BYTES // first.nbytes))
    return [first] + [_clone(first) for _ in range(copies - 1)], gguf_bytes


def _clone(pw: PackedWeight) -> PackedWeight:
    fields = ("codes", "scale", "high", "minv", "d", "dmin")
    cloned = {f: None if getattr(pw, f) is None else getattr(pw, f).clone() for f in fields}
    return PackedWeight(pw.ggml_type, pw.shape, **cloned, high_layout=pw.high_layout)


def bench_shape(ggml_type: str, shape: str, copy_gbs: float, mm_tflops: float) -> dict:
    k, n = SHAPES[shape]
    pws, gguf_bytes = rotated(ggml_type, n, k)
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    t1 = graph_time([lambda pw=pw: tq.qgemv(x1, pw) for pw in pws], 20)
    row = {"type": ggml_type, "shape": shape, "N": n, "K": k, "gguf_bytes": gguf_bytes}
    row.update(packed_bytes=pws[0].nbytes, t1_us=t1 * 1e6, t1_gbs=pws[0].nbytes / t1 / 1e9)
    row["t1_frac"] = row["t1_gbs"] / copy_gbs
    x512 = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 512 * n * k
    w0 = pws[0]
    for name, fn in (("dense", tq.dense_mm), ("mm", tq.qmm)):
        sec = graph_time([lambda fn=fn: fn(x512, w0)], 10)
        row[f"t512_{name}_us"] = sec * 1e6
        row[f"t512_{name}_tflops"] = flops / sec / 1e12
    best = max(row["t512_dense_tflops"], row["t512_mm_tflops"])
    row["t512_frac"] = best / mm_tflops
    pws.clear()
    torch.cuda.empty_cache()
    return row


def crossover(ggml_type: str, shape: str, tokens: list[int]) -> list[dict]:
    """us per call of each path over T, one type and shape."""
    k, n = SHAPES[shape]
    pws, _ = rotated(ggml_type, n, k)
    rows = []
    for t in tokens:
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        row = {"type": ggml_type, "shape": shape, "T": t}
        paths = {"gemv": tq.qgemv, "mm": tq.qmm, "dense": tq.dense_mm}
        for name, fn in paths.items():
            if name == "gemv" and t > 8:
                continue
            weights = pws if name != "dense" else pws[:1]
            fns = [lambda w=w, f=fn, x=x: f(x, w) for w in weights]
            row[name + "_us"] = 1e6 * graph_time(fns, 10)
        rows.append(row)
    return rows


def gemv_sweep(ggml_type: str, shape: str, copy_gbs: float) -> list[dict]:
    """Decode kernel at T = 1 over rows a program and programs per SM (the split of K)."""
    k, n = SHAPES[shape]
    pws, _ = rotated(ggml_type, n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    base = tq.gemv_block_n(pws[0].spec)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for block_n in (base // 2, base, base * 2):
        for per_sm in (2, 4, 8, 16):
            split = max(1, per_sm * sms // -(-n // block_n))
            fns = [
                lambda w=w, s=split, b=block_n: tq.qgemv(x, w, split_k=s, block_n=b) for w in pws
            ]
            sec = graph_time(fns, 10)
            gbs = pws[0].nbytes / sec / 1e9
            rows.append(
                {
                    "type": ggml_type,
                    "shape": shape,
                    "block_n": block_n,
                    "ctas_per_sm": per_sm,
                    "split": split,
                    "us": sec * 1e6,
                    "gbs": gbs,
                    "frac": gbs / copy_gbs,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def dense_bf16_gemv(shape: str, copy_gbs: float) -> dict:
    """cuBLAS on a bf16 copy of the weight at T = 1: what a dense matvec reaches."""
    k, n = SHAPES[shape]
    copies = max(1, min(128, ROTATE_BYTES // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    sec = graph_time([lambda w=w: x @ w.t() for w in ws], 20)
    gbs = 2 * n * k / sec / 1e9
    return {"shape": shape, "bf16_t1_us": sec * 1e6, "gbs": gbs, "frac": gbs / copy_gbs}


def print_tables(ceil: dict, out: dict) -> None:
    rows, cross, dense = out["rows"], out["crossover"], out["dense"]
    print(
        f"\ndevice: {ceil['device']}; copy {ceil['copy_gbs']:.0f} GB/s (read+write), "
        f"bf16 mm {ceil['mm_tflops']:.0f} TFLOP/s"
    )
    for r in out["sweep"]:
        print(
            f"decode sweep {r['type']} {r['shape']:20s} BN={r['block_n']:4d} "
            f"{r['ctas_per_sm']:2d}/SM split={r['split']:3d}: {r['us']:8.1f} us {r['frac']:5.0%}"
        )
    for d in dense:
        print(
            f"cuBLAS bf16 matvec {d['shape']}: {d['bf16_t1_us']:.1f} us, {d['gbs']:.0f} GB/s "
            f"({d['frac']:.0%} of copy)"
        )
    if cross:
        print("\ncrossover (us per call):  T | gemv | mm | dense")
        for r in cross:
            cells = [
                f"{r[p + '_us']:8.1f}" if p + "_us" in r else "       -"
                for p in ("gemv", "mm", "dense")
            ]
            print(f"  {r['type']} {r['shape']:20s} T={r['T']:4d} " + " ".join(cells))
    print(
        f"\n{'type':5s} {'shape':20s} {'MB':>7s} | {'T=1 us':>8s} {'GB/s':>6s} {'copy':>5s} | "
        f"{'T=512 dense us':>14s} {'TF/s':>5s} | {'mm us':>8s} {'TF/s':>5s} {'best':>5s}"
    )
    for r in rows:
        print(
            f"{r['type']:5s} {r['shape']:20s} {r['packed_bytes'] / 1e6:7.1f} | "
            f"{r['t1_us']:8.1f} {r['t1_gbs']:6.0f} {r['t1_frac']:5.0%} | "
            f"{r['t512_dense_us']:14.1f} {r['t512_dense_tflops']:5.0f} | "
            f"{r['t512_mm_us']:8.1f} {r['t512_mm_tflops']:5.0f} {r['t512_frac']:5.0%}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--shapes", default="all", help="comma-separated prefixes of SHAPES keys")
    ap.add_argument("--crossover", default="Q4_K:gate/up 4096x14336,Q4_K:q/o 4096x4096")
    ap.add_argument("--tokens", default="1,2,3,4,8,16,32,64,128,192,256,512")
    ap.add_argument("--sweep", default="", help="TYPE:SHAPE,...: decode-kernel configurations")
    ap.add_argument("--json", default=None, help="write every number here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    names = [
        s
        for s in SHAPES
        if args.shapes == "all" or any(s.startswith(p) for p in args.shapes.split(","))
    ]
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if get_quant(t).ggml_type not in SPECS]
    if unknown:
        raise SystemExit(f"no Triton layout for {unknown}")
    ceil = {"device": torch.cuda.get_device_name(), "mm_tflops": matmul_rate()}
    ceil["copy_gbs"] = copy_bandwidth()
    print(f"copy {ceil['copy_gbs']:.0f} GB/s, bf16 mm {ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
    out: dict = {"ceilings": ceil, "rows": [], "crossover": [], "dense": [], "sweep": []}
    started = time.time()
    tokens = [int(t) for t in args.tokens.split(",")]
    sweeps = [item.split(":") for item in filter(None, args.sweep.split(","))]
    jobs = {t: ([1, 512], []) for t in types}
    for stype, _ in sweeps:
        base = tq.gemv_block_n(SPECS[get_quant(stype).ggml_type])
        jobs.setdefault(stype, ([1, 512], []))[1].extend([base // 2, base, base * 2])
    crosses = [item.split(":") for item in filter(None, args.crossover.split(","))]
    for ctype, _ in crosses:
        jobs.setdefault(ctype, ([1, 512], []))[0].extend(tokens)
    warm_up(jobs)
    print(f"compiled in {time.time() - started:.0f} s", flush=True)
    for stype, sshape in sweeps:
        out["sweep"] += gemv_sweep(stype, sshape, ceil["copy_gbs"])
    out["dense"] = [dense_bf16_gemv(s, ceil["copy_gbs"]) for s in names[:2]]
    for ctype, cshape in crosses:
        out["crossover"] += crossover(ctype, cshape, tokens)
    for t in types:
        for s in names:
            row = bench_shape(t, s, ceil["copy_gbs"], ceil["mm_tflops"])
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
    out["seconds"] = time.time() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print_tables(ceil, out)


if __name__ == "__main__":
    main()
