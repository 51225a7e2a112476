"""Micro-benchmarks of one device: copy bandwidth, matmul rates per weights mode, links.

Timings are medians of repeated calls after a warm-up; weights rotate over copies larger than
the caches (as a model's layers stream), so a decode rate is a DRAM/HBM rate, not an L2 one.
On a CPU the shapes are moderate so that the whole profile takes seconds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hetero.kernels import select
from hetero.kernels.cpu_linear import available_schemes, pack_linear, packed_linear
from hetero.kernels.cpu_qdot import cpu_scheme
from hetero.kernels.registry import prepare_weight
from hetero.planner.device import MatmulRate
from hetero.quant import get_quant, random_blocks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, budget_s: float = 0.2) -> float:
    """Median seconds of one call of `fn` (after one warm-up call), over ~budget_s."""
    fn()
    sync(device)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replayed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """On CUDA, `fn` captured once in a CUDA graph and replayed: decode steps replay their
    kernels from graphs (engine/cuda_graph.py), so timing Python launches instead would measure
    the host (a T = 1 GEMV of 20 us launched eagerly reads as a few hundred GB/s). Where capture
    fails, `fn` itself (eager launches, as an eager step has them)."""
    if device.type != "cuda":
        return fn
    with torch.cuda.device(device):  # a second GPU's kernels must run on its own stream
        fn()  # compile and allocate outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
                fn()
        except RuntimeError:
            torch.cuda.synchronize(device)
            return fn

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return replay


def copy_gbs(device: torch.device, nbytes: int) -> float:
    """Read + write GB/s of a copy of `nbytes` (larger than the caches)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sec = time_call(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / sec / 1e9


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sec = time_call(lambda: a @ b, device)
    return 2 * n**3 / sec / 1e12


def _rotation(make: Callable[[], object], nbytes: Callable[[object], int], rotate: int) -> list:
    """Copies of one weight, enough that they hold `rotate` bytes together."""
    first = make()
    return [first] + [make() for _ in range(math.ceil(rotate / nbytes(first)) - 1)]


def streamed_gbs(
    weights: list, call: Callable, t: int, k: int, nbytes: int, device: torch.device,
    dtype: torch.dtype,
) -> float:  # fmt: skip
    """Weight GB/s of `call` at T = t over the rotated copies `weights` (nbytes each)."""
    x = torch.randn(t, k, device=device, dtype=dtype)
    calls = replayed(lambda: [call(x, w) for w in weights], device)
    return nbytes / (time_call(calls, device) / len(weights)) / 1e9


def linear_rate(
    kernel: str,
    weights: list,
    call: Callable[[torch.Tensor, object], object],
    shape: tuple[int, int],
    weight_bytes: int,
    device: torch.device,
    dtype: torch.dtype,
    prefill_t: int,
    curve_t: tuple[int, ...] = (),
    small: tuple[list, int, int] | None = None,
) -> MatmulRate:
    """Decode GB/s at T = 1 and at each T of curve_t (over the rotated copies: the weights come
    from DRAM/HBM, as a batched decode step's do) and prefill TFLOP/s at T = prefill_t.
    small: (weights, K, bytes) of a smaller matrix, timed at T = 1 too (MatmulRate.sizes)."""
    n, k = shape

    def gbs(t: int, ws: list = weights, kk: int = k, nbytes: int = weight_bytes) -> float:
        return streamed_gbs(ws, call, t, kk, nbytes, device, dtype)

    xp = torch.randn(prefill_t, k, device=device, dtype=dtype)
    tp = time_call(lambda: call(xp, weights[0]), device)
    curve = tuple((t, gbs(t)) for t in curve_t)
    sizes = ()
    if small is not None:
        ws, ks, nbytes = small
        sizes = (float(nbytes), gbs(1, ws, ks, nbytes), float(weight_bytes))
    return MatmulRate(kernel, gbs(1), 2 * prefill_t * n * k / tp / 1e12, curve, prefill_t, sizes)


CPU_CURVE_T = (4, 16)  # few points: the CPU profile stays quick
# The GGUF types the CPU profile times qdot on besides Q4_1 ("qdot"): a Q4_K_M file's (Q4_K, Q6_K),
# Q8_0, and the codebook types (kernels/cpu_qcodebook.c), whose table lookups unpack at their own
# rates (IQ4_XS files; gpt-oss's MXFP4 experts)
QDOT_TYPES = ("Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
# Every graph bucket a batched decode runs at on CUDA, the qmm/dense crossover, a prefill chunk.
GPU_CURVE_T = (2, 4, 8, 16, 32, 64, 128, 256, 512)
GPU_PREFILL_T = 2048


def cpu_cache_bytes() -> int:
    """The largest CPU cache (the last level), from sysfs; 0 where it is not readable."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes)


def cpu_stream_bytes(least: int) -> int:
    """Bytes a CPU bandwidth measurement streams: at least `least` and 4x the last-level cache,
    so that no pass is served from it (a server CPU's L3 holds 100 MB and more)."""
    return max(least, 4 * cpu_cache_bytes())


def cpu_matmul_rates(
    shape=(28672, 4096), small=(4096, 1024), rotate_bytes=256 << 20, prefill_t=64
) -> dict:
    """qdot (where it builds), fp16 (fbgemm repack) and dense fp32: the modes a CPU stage runs.
    qdot reads each GGUF type's own blocks, whose unpacking costs differ: it is timed on Q4_1
    (the default model's) as "qdot", and as "qdot:<type>" on each of QDOT_TYPES the kernel
    table has; the cost model asks for a tensor's own type first (model_desc.rate_key,
    DeviceProfile.matmul_rate). Weights rotate through copies larger than the last-level
    cache. Each mode is timed on `shape` (its rates) and at T = 1 on `small` too
    (MatmulRate.sizes). `shape` is an 8B's joined gate|up: on the 16-core host of the GPU
    machine the qdot kernel read Q4_K at 43, 61 and 83 GB/s at T = 1 on 4096 x 1024, 8192 x
    4096 and 28672 x 4096 (Q6_K 66, 86, 106), and a plan priced from the first alone put a
    split's CPU layers at 2x their measured time."""
    from gguf import GGMLQuantizationType

    cpu, f32 = torch.device("cpu"), int(GGMLQuantizationType.F32)
    rotate_bytes = cpu_stream_bytes(rotate_bytes)

    def sources(shp: tuple[int, int]) -> dict[str, tuple[torch.Tensor, int]]:
        w = torch.randn(shp) * 0.02

        def blocks(name: str) -> tuple[torch.Tensor, int]:
            size = get_quant(name).block_size
            raw = random_blocks(name, w.numel() // size, np.random.default_rng(0))
            return torch.from_numpy(raw).reshape(shp[0], -1), int(GGMLQuantizationType[name])

        out = {"qdot": blocks("Q4_1")}
        out |= {f"qdot:{t}": blocks(t) for t in QDOT_TYPES if cpu_scheme(t) == "qdot"}
        return out | {"fp16": (w, f32), "dense": (w, f32)}

    large, little = sources(shape), sources(small)
    schemes = {"qdot": ("qdot", "cpu-qdot"), "fp16": ("fp16", "fbgemm-fp16"),
               "dense": ("fp32", "torch")}  # fmt: skip

    def packs(shp: tuple[int, int], src: tuple[torch.Tensor, int], scheme: str) -> list:
        make = lambda: pack_linear(src[0], src[1], shp, scheme)  # noqa: E731
        return _rotation(make, lambda p: p.nbytes, rotate_bytes)

    rates = {}
    for mode in large:
        scheme, kernel = schemes[mode.split(":")[0]]
        if scheme not in available_schemes():
            continue
        few, many = packs(small, little[mode], scheme), packs(shape, large[mode], scheme)
        rates[mode] = linear_rate(
            kernel, many, packed_linear, shape, many[0].nbytes, cpu, torch.float32, prefill_t,
            CPU_CURVE_T, small=(few, small[1], few[0].nbytes),
        )  # fmt: skip
    # The qdot types' T = 1 rates (a CPU stage's decode) looked at a second time, after the
    # others: interference only ever slows a bandwidth, so each keeps the faster look. On the
    # 16-core host of the GPU machine one profile read Q6_K at 65 GB/s where a decode in the same
    # session streamed a Q6_K head at 112 (another profile: 106), and its plan priced a split's
    # decode at 0.74x the measured; within one process the looks agree to ~5%.
    for mode in [m for m in rates if m.startswith("qdot")]:
        few, many = packs(small, little[mode], "qdot"), packs(shape, large[mode], "qdot")
        r = rates[mode]
        big = streamed_gbs(many, packed_linear, 1, shape[1], many[0].nbytes, cpu, torch.float32)
        lit = streamed_gbs(few, packed_linear, 1, small[1], few[0].nbytes, cpu, torch.float32)
        rates[mode] = dataclasses.replace(
            r,
            decode_gbs=max(r.decode_gbs, big),
            sizes=(r.sizes[0], max(r.sizes[1], lit), r.sizes[2]),
        )
    return rates


def cpu_prefill_attention_tflops(n: int = 512, heads: tuple[int, int] = (32, 8), d: int = 128):
    """TFLOP/s of the CPU's paged attention (the op the registry picks) over a prompt of n
    tokens, causal, in an fp16 cache (the CPU's KV): an 8B's heads. The cost model's prefill
    attention flops, 4 n (n / 2) H D a layer, over its time. The matmul rate stood in before:
    on the 2-core development machine this attention ran at 73 GFLOP/s where an fp32 matmul
    runs at ~160, and a split's CPU layers, whose prompt matmuls stream to the GPU, are mostly
    this attention."""
    from hetero.execution.runner import PagedMeta

    h, kv = heads
    cpu = torch.device("cpu")
    attend = select("paged_attention", cpu).fn
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(n, kv, d, generator=g)).to(torch.float16)
    v = (torch.randn(n, kv, d, generator=g)).to(torch.float16)
    q = torch.randn(n, h, d, generator=g)
    meta = PagedMeta([0], [n], [torch.arange(n)])
    sec = time_call(lambda: attend(q, k, v, None, None, meta, d**-0.5), cpu)
    return 4.0 * n * (n / 2) * h * d / sec / 1e12


def gpu_matmul_rates(
    device: torch.device,
    types: list[str],
    shape=(14336, 4096),
    rotate_bytes=512 << 20,
    curve_t: tuple[int, ...] = GPU_CURVE_T,
    prefill_t: int = GPU_PREFILL_T,
) -> dict:
    """The registry's qlinear kernel per GGUF type ("quant:<type>") and bf16 dense."""

    impl = select("qlinear", device)
    n, k = shape
    rates = {}
    for name in types:
        qt = get_quant(name)
        blocks = random_blocks(name, n * k // qt.block_size, np.random.default_rng(0))
        raw = torch.from_numpy(blocks).reshape(n, -1).to(device)
        ws = _rotation(
            lambda raw=raw, t=int(qt.ggml_type): prepare_weight(impl, raw.clone(), t, shape),
            lambda _, size=raw.nbytes: size,
            rotate_bytes,
        )

        def call(x, w, t=int(qt.ggml_type)):
            return impl.fn(x, w, t, shape)

        rates[f"quant:{name}"] = linear_rate(
            impl.name, ws, call, shape, raw.nbytes, device, torch.bfloat16, prefill_t, curve_t,
        )  # fmt: skip
        del ws, raw
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    ws = _rotation(dense.clone, lambda w: w.nbytes, rotate_bytes)
    rates["dense"] = linear_rate(
        "torch", ws, lambda x, w: x @ w.t(), shape, dense.nbytes, device, torch.bfloat16,
        prefill_t, curve_t,
    )  # fmt: skip
    return rates


def link_gbs(src: torch.device, dst: torch.device, nbytes: int = 256 << 20) -> float:
    """GB/s of one copy from src to dst (pinned host memory on the CPU side)."""
    pin = torch.cuda.is_available()
    a = torch.empty(nbytes, dtype=torch.uint8, device=src, pin_memory=pin and src.type == "cpu")
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst, pin_memory=pin and dst.type == "cpu")
    gpu = src if src.type == "cuda" else dst
    return nbytes / time_call(lambda: b.copy_(a, non_blocking=True), gpu) / 1e9


def link_latency_s(gpu: torch.device) -> float:
    """Seconds of a small (one hidden vector) host -> device -> host round trip, halved."""
    a = torch.zeros(4096, dtype=torch.bfloat16)
    return time_call(lambda: a.to(gpu).to("cpu"), gpu) / 2
