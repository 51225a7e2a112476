"""Triton paged decode attention and KV write on the GPU: time per call against copy bandwidth.

    python benchmarks/gpu_paged.py [--batches 1,8,64] [--contexts 512,4096] [--kv fp8,fp16]
        [--max-len 8192] [--variants all] [--min-splits 64] [--stages 3] [--bn 32,64]
        [--splits 0,1,2,3]

Llama-3-8B attention (32 query heads over 8 KV heads, D = 128, blocks of 16), one layer. Decode
reads each sequence's K and V once (plus fp8 scales): GB/s = those bytes / time, as a fraction of
the device-to-device copy bandwidth measured in the same run. Calls replay from a CUDA graph, 32
in a row as a step's layers run them (device time and the gaps between launches, not the host's
launch overhead). The fused KV write of the step's new tokens is timed too.

--max-len sizes the grid as a CUDA graph captured for that context does (the engine's graphs
take the model's context; default: each row's own). --variants: "merge" (the default path:
fp8 by the conversion instruction where the GPU has it, the splits merged in the decode
kernel), "reduce" (merged by the reduce kernel after it), "int" (fp8 decoded with integers, as
sm_80/86 do), "int-reduce", "rope" (q and the new key rotated, k and v stored in the kernel:
a decode step's launch); "all" for the five. --min-splits: the fewest keys a split takes;
--stages: the decode loop's software pipeline (ptxas, sm_90: 96-128 registers at 1 stage, 140
at 2, 143-145 at 3 or 4). --bn: keys a loop step (DECODE_BN); --splits: the grid's splits
forced (0: `decode_splits`' own; at 64 streams of 512 keys it takes one, 512 programs, which
at 128 registers, 4 programs an SM, are one wave of the H200's 528).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_qmatmul import copy_bandwidth, graph_time  # noqa: E402

from hetero.execution.paged_meta import TensorMeta  # noqa: E402
from hetero.kernels import triton_paged as tp  # noqa: E402
from hetero.kernels.paged import FP8  # noqa: E402

H, KV, D, BS = 32, 8, 128, 16


def setup(batch: int, ctx: int, kv_dtype: str):
    """A pool holding `batch` contexts of `ctx` tokens in shuffled blocks, and a decode step."""
    nb = -(-ctx // BS)
    slots = batch * nb * BS
    dtype = FP8 if kv_dtype == "fp8" else torch.float16
    k = torch.randn(slots, KV, D, device="cuda").to(dtype)
    v = torch.randn(slots, KV, D, device="cuda").to(dtype)
    ks = vs = None
    if dtype == FP8:
        ks = torch.rand(slots, KV, device="cuda")
        vs = torch.rand(slots, KV, device="cuda")
    tables = torch.randperm(batch * nb, device="cuda").view(batch, nb).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    meta = TensorMeta(tables, lens, starts, 1, ctx, BS)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    return q, (k, v, ks, vs), meta


def kv_bytes(batch: int, ctx: int, kv_dtype: str) -> int:
    per = D * (1 if kv_dtype == "fp8" else 2) + (4 if kv_dtype == "fp8" else 0)
    return 2 * batch * ctx * KV * per


VARIANTS = {
    "merge": (True, True),
    "reduce": (True, False),
    "int": (False, True),
    "int-reduce": (False, False),
    "rope": (True, True),
}  # (fp8 by the instruction, merged in the kernel); "rope": q and k rotated, k and v stored in it


def rope_args(q: torch.Tensor, meta: TensorMeta, ctx: int) -> tuple:
    """A decode step's new k, v [B, KV, D], rotation tables [B, D/2], style and slots (each
    sequence's last position's: the kernel stores the new key there, as a step does)."""
    b = q.shape[0]
    k, v = (torch.randn(b, KV, D, device="cuda", dtype=q.dtype) for _ in range(2))
    ang = torch.rand(b, D // 2, device="cuda") * 6.3
    last = ctx - 1
    slots = meta.block_tables[:, last // BS].long() * BS + last % BS
    return k, v, ang.cos(), ang.sin(), "normal", slots


def row(batch: int, ctx: int, kv_dtype: str, copy_gbs: float, max_len: int, variant: str,
        min_split: int, stages: int, bn: int = 0, splits: int = 0) -> str:  # fmt: skip
    q, caches, meta = setup(batch, ctx, kv_dtype)
    meta.max_seq_len = max_len or ctx
    hw, merge = VARIANTS[variant]
    scale = D**-0.5
    saved = tp.hw_fp8, tp.MIN_SPLIT, tp.DECODE_STAGES, tp.DECODE_BN
    tp.hw_fp8 = lambda device: hw and saved[0](device)
    tp.MIN_SPLIT, tp.DECODE_STAGES, tp.DECODE_BN = min_split, stages, bn or saved[3]
    try:
        rope = rope_args(q, meta, ctx) if variant == "rope" else None
        n = splits or None

        def call():
            return tp.paged_decode(q, *caches, meta, scale, n, merge=merge, rope=rope)

        sec = graph_time([call] * 32, 50)
        bn = tp.DECODE_BN
    finally:
        tp.hw_fp8, tp.MIN_SPLIT, tp.DECODE_STAGES, tp.DECODE_BN = saved
    gbs = kv_bytes(batch, ctx, kv_dtype) / sec / 1e9
    k_new = torch.randn(batch, KV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda") * BS
    wsec = graph_time([lambda: tp.kv_write_triton(*caches, slots, k_new, k_new)] * 32, 50)
    grid = splits or tp.decode_splits(
        batch, KV, meta.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count
    )
    return (
        f"{kv_dtype:4s} B={batch:3d} ctx={ctx:5d} grid splits {grid:2d} min {min_split:3d} "
        f"stages {stages} bn {bn} {variant:10s}: decode {sec * 1e6:8.2f} us, {gbs:7.0f} GB/s "
        f"({gbs / copy_gbs:4.0%} of copy); kv write {wsec * 1e6:6.2f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--kv", default="fp8,fp16")
    ap.add_argument("--max-len", type=int, default=0)
    ap.add_argument("--variants", default="merge")
    ap.add_argument("--min-splits", default=str(tp.MIN_SPLIT))
    ap.add_argument("--stages", default=str(tp.DECODE_STAGES))
    ap.add_argument("--bn", default=str(tp.DECODE_BN), help="keys a loop step")
    ap.add_argument("--splits", default="0", help="the grid's splits (0: decode_splits')")
    args = ap.parse_args()
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; {H} heads over {KV}, D {D}, blocks of {BS}")
    ints = lambda arg: [int(x) for x in arg.split(",")]  # noqa: E731
    for kv_dtype, ctx, b, v, ms, st, bn, n in itertools.product(
        args.kv.split(","), ints(args.contexts), ints(args.batches), variants,
        ints(args.min_splits), ints(args.stages), ints(args.bn), ints(args.splits),
    ):  # fmt: skip
        print(row(b, ctx, kv_dtype, copy_gbs, args.max_len, v, ms, st, bn, n), flush=True)


if __name__ == "__main__":
    main()
