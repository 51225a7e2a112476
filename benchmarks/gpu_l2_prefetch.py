"""Does a decode GEMV gain from its weight being pulled into L2 while the kernels before it run?

    python benchmarks/gpu_l2_prefetch.py [--types Q4_K,Q6_K] [--shapes qo,qk,kv,gateup2,down]
        [--idle-us 12] [--fraction 1.0]

A decode step leaves the memory system idle during its small kernels (norms, rotation, the
attention over a short context: ~25 us a layer of the 8B at B = 1), then each GEMV streams its
weight from DRAM, the small ones (q|k, v, o: 2-12 MB) well below the copy rate. Per (type,
shape), CUDA-graph replays over copies of the weight (cold, as a model's layers are), us a call:

    cold        the GEMV alone (the tuning table's config)
    warm        the same weight every call (it stays in L2)
    idle+gemv   a spin kernel of --idle-us (one thread: the small kernels' stand-in), then the GEMV
    +bulk       the same, and on a side stream during the spin: the weight's planes prefetched
                into L2 (sm_90 `cp.async.bulk.prefetch.L2`, a few threads)
    +loads      the same with a Triton kernel that loads the planes (evict_last) and discards
    idle        the spin alone

(idle+gemv) - idle against (+bulk) - idle is what a prefetch buys a GEMV; --fraction prefetches
only the first part of each plane (for weights larger than L2 leaves room for).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gemv_suite_cells import SHAPES, make_weight, rotated  # noqa: E402
from gpu_qmatmul import event_times  # noqa: E402

from hetero.kernels import streamk as sk  # noqa: E402
from hetero.kernels.xquant import XLayout, xquant  # noqa: E402


@triton.jit
def _bulk_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    off = i.to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32) // 16 * 16
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2;"
        " mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _loads_kernel(ptr, n, out, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = (pid * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(out + pid, tl.sum(acc))


def bulk_prefetch(t: torch.Tensor, fraction: float, chunk: int = 32768, lanes: int = 32):
    nbytes = int(t.numel() * t.element_size() * fraction)
    n_chunks = triton.cdiv(nbytes, chunk)
    _bulk_kernel[(triton.cdiv(n_chunks, lanes),)](
        t.data_ptr(), nbytes, CHUNK=chunk, LANES=lanes, num_warps=1
    )


_SINK: dict = {}


def loads_prefetch(t: torch.Tensor, fraction: float, block: int = 2048, iters: int = 8):
    w = t.view(torch.int32) if t.element_size() * t.numel() % 4 == 0 else t.view(torch.uint8)
    n = int(w.numel() * fraction)
    grid = triton.cdiv(n, block * iters)
    sink = _SINK.get(grid)
    if sink is None:
        sink = _SINK[grid] = torch.empty(grid, dtype=torch.int32, device=t.device)
    _loads_kernel[(grid,)](w, n, sink, BLOCK=block, ITERS=iters, num_warps=4)


def graph_us(body, copies: int, reps: int = 30) -> float:
    """us per iteration of body(i) for i over copies, from CUDA-graph replays."""
    for i in range(copies):
        body(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            body(i)
    g.replay()
    torch.cuda.synchronize()
    times = sorted(event_times(g.replay, reps))
    return times[len(times) // 2] / copies * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="qo,kv,qk,gateup2,down")
    ap.add_argument("--idle-us", type=float, default=12.0)
    ap.add_argument("--fraction", type=float, default=1.0)
    args = ap.parse_args()
    probe = 200_000  # cycles of the spin kernel, timed to find its clock
    cycles = int(args.idle_us / graph_us(lambda _i: torch.cuda._sleep(probe), 4) * probe)
    side = torch.cuda.Stream()
    for ggml_type in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            pws = rotated(make_weight(ggml_type, n, k, "bytes"))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            cfg = sk.choose(pws[0], x)
            xq = xquant(x, XLayout(pws[0].spec.low_bits, pws[0].spec.group))
            if cfg is None or not cfg.int_dot:
                print(f"{ggml_type} {shape}: no integer Stream-K config", flush=True)
                continue

            def gemv(i, pws=pws, x=x, cfg=cfg, xq=xq):
                sk.qgemv_streamk(x, pws[i], cfg, xq=xq)

            def idle(_i):
                torch.cuda._sleep(cycles)

            def with_prefetch(fetch, frac=args.fraction, pws=pws, gemv=gemv):
                def body(i):
                    main_s = torch.cuda.current_stream()
                    side.wait_stream(main_s)
                    torch.cuda._sleep(cycles)
                    with torch.cuda.stream(side):
                        for t in pws[i].planes():
                            fetch(t, frac)
                    main_s.wait_stream(side)
                    gemv(i)

                return body

            c = len(pws)
            bodies = {
                "cold": gemv,
                "warm": lambda _i, g=gemv: g(0),
                "idle+gemv": lambda i, g=gemv: (idle(i), g(i)),
                "+bulk": with_prefetch(bulk_prefetch),
                "+loads": with_prefetch(loads_prefetch),
                "idle": idle,
            }
            row = {}
            for name, fn in bodies.items():
                try:
                    row[name] = graph_us(fn, c)
                except Exception as e:  # reported, the other rows still run
                    print(f"{ggml_type} {shape} {name}: {type(e).__name__}: {str(e)[:300]}")
                    row[name] = float("nan")
            mb = pws[0].nbytes / 1e6
            cells = "  ".join(f"{k} {v:7.2f}" for k, v in row.items())
            gain = row["idle+gemv"] - min(row["+bulk"], row["+loads"])  # nan if both failed
            print(f"{ggml_type} {shape:8} {mb:6.1f} MB {cfg.name:32} {cells}  gain {gain:5.2f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
