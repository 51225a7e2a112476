"""The integer tensor-core matmul (kernels/mmq.py) against the float kernels, on one GPU.

    python benchmarks/gpu_mmq.py [--tokens 16,32,64] [--types Q4_K,Q6_K] [--bt 16,32,64]
                                 [--configs 64x8,128x8,64x4]

Llama-3-8B linear shapes (fused q|k|v 6144 x 4096, o 4096 x 4096, fused gate|up 28672 x 4096,
down 4096 x 14336), random blocks, weights rotated over copies (>= 256 MB a replay, five times
the L2) and replayed from a CUDA graph (device time). Per T: us per call of `qlinear` as the
engine runs it (kernels/qdispatch.py's choice) and of `mmq_linear` at each block of bt rows and
each config (weight rows a program x chunks a step: mmq.BN x mmq.STEP);
GB/s of weight bytes and the share of the copy bandwidth measured in the same run; the largest
error of each against the float32 reference, relative to the output's largest value.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from hetero.kernels import mmq
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.reference import qlinear_ref
from hetero.kernels.repack import repack
from hetero.quant import get_quant, random_blocks

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gateup": (28672, 4096), "down": (4096, 14336)}
ROTATE = 256 << 20


def copy_gbs(device: torch.device) -> float:
    a = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    stop.record()
    torch.cuda.synchronize()
    return 5 * 2 * a.numel() / (start.elapsed_time(stop) / 1e3) / 1e9


def timed(fn, copies: int) -> float:
    """us a call: `fn(i)` over the copies, replayed from a CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / 10 / copies


def kernels(x, packs, ggml_type: int, shape: tuple[int, int], bts: list[int], configs) -> dict:
    """label -> fn(i): the call on weight copy i (an mmq config set as its call runs)."""
    runs = {"qlinear": lambda i: tq.qlinear_triton(x, packs[i], ggml_type, shape)}

    def run(i: int, bt: int, bn: int, step: int) -> torch.Tensor:
        mmq.BN, mmq.STEP = bn, step
        return mmq.mmq_linear(x, packs[i], bt)

    for bt in bts:
        for bn, step in configs:
            runs[f"mmq {bt}/{bn}x{step}"] = functools.partial(run, bt=bt, bn=bn, step=step)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", default="16,32,64")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--bt", default="16,32,64")
    ap.add_argument("--configs", default="64x8", help="mmq rows a program x chunks a step")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_gbs(dev)
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    print(f"{'type':>5} {'shape':>7} {'T':>4} {'kernel':>15} {'us':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'max err':>9}")  # fmt: skip
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qt = get_quant(name)
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            nbytes = n * k // qt.block_size * qt.type_size
            copies = max(1, -(-ROTATE // nbytes))
            raws = [
                torch.from_numpy(random_blocks(name, n * k // qt.block_size, rng)).to(dev)
                for _ in range(copies)
            ]
            packs = [repack(r.view(n, -1), int(qt.ggml_type), (n, k)) for r in raws]
            for t in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
                want = qlinear_ref(x.float(), raws[0].view(n, -1), int(qt.ggml_type), (n, k))
                top = want.abs().max().item()
                bts = [int(v) for v in args.bt.split(",")]
                cfgs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
                for label, fn in kernels(x, packs, int(qt.ggml_type), (n, k), bts, cfgs).items():
                    err = (fn(0).float() - want).abs().max().item() / top
                    us = timed(fn, copies)
                    gbs = nbytes / (us / 1e6) / 1e9
                    print(f"{name:>5} {shape:>7} {t:>4} {label:>15} {us:>8.1f} {gbs:>7.0f} "
                          f"{gbs / bw:>8.0%} {err:>9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
