"""The hot kernels of a Llama-3-8B decode step, launched a few times each for Nsight Compute.

    ncu --clock-control none --kernel-name regex:"qgemv|qmm|decode_split" --launch-skip 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/gpu_kernel_probe.py [--types Q4_K] [--tokens 1,64] [--batches 1,64]

Each launch runs REPEATS times (the first compiles; skip it with --launch-skip): the default
quantized-matmul path of each type at each T on the gate/up and down shapes, then the paged
decode attention (fp8 KV, 576 positions a sequence) at each batch size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_paged import setup  # noqa: E402
from gpu_qmatmul import make_packed  # noqa: E402

from hetero.kernels import triton_paged as tp  # noqa: E402
from hetero.kernels.triton_qmatmul import qlinear_triton  # noqa: E402

REPEATS = 3
PROBE_SHAPES = {"gate/up": (14336, 4096), "down": (4096, 14336)}  # (N, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_K")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=576)
    args = ap.parse_args()
    for ggml_type in args.types.split(","):
        for name, (n, k) in PROBE_SHAPES.items():
            pw, _ = make_packed(ggml_type, n, k, seed=0)
            for t in (int(x) for x in args.tokens.split(",") if x):
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
                print(f"{ggml_type} {name} T={t}", flush=True)
                for _ in range(REPEATS):
                    qlinear_triton(x, pw, pw.ggml_type, (n, k))
                torch.cuda.synchronize()
    for b in (int(x) for x in args.batches.split(",") if x):
        q, caches, meta = setup(b, args.context, "fp8")
        print(f"attention B={b} context {args.context}", flush=True)
        for _ in range(REPEATS):
            tp.paged_decode(q, *caches, meta, 128**-0.5)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
