"""The CPU profile's T = 1 qdot rates, looked at several times in one process: how much they
move within a process (against how much they move between profiles).

    python benchmarks/profile_cpu_rates.py [--types Q4_K,Q6_K] [--rounds 4] [--threads 0]

Each type is timed as `hetero profile` times it (profiler/measure.py: packed copies rotated over
more bytes than the last-level cache, the median of the calls over ~0.2 s) on an 8B's joined
gate|up (28672 x 4096) and on 4096 x 1024, the types taking turns, 2 s between rounds. GB/s of
weight bytes; threads 0: the kernels' default (kernels/cpu_threads).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType

from hetero.kernels import cpu_threads
from hetero.kernels.cpu_linear import pack_linear, packed_linear
from hetero.profiler.measure import _rotation, cpu_stream_bytes, streamed_gbs
from hetero.quant import get_quant, random_blocks

SHAPES = ((28672, 4096), (4096, 1024))


def main() -> None:
    import torch  # (after hetero's import: its OMP_WAIT_POLICY comes first)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    print("threads", cpu_threads.configure(args.threads))
    rotate = cpu_stream_bytes(256 << 20)
    packs = {}
    for name in args.types.split(","):
        qtype = int(GGMLQuantizationType[name])
        for n, k in SHAPES:
            raw = random_blocks(name, n * k // get_quant(name).block_size, np.random.default_rng(0))
            src = torch.from_numpy(raw).reshape(n, -1)
            make = lambda src=src, n=n, k=k, q=qtype: pack_linear(src, q, (n, k), "qdot")  # noqa: E731
            packs[(name, n, k)] = _rotation(make, lambda p: p.nbytes, rotate)
    for r in range(args.rounds):
        cells = []
        for (name, n, k), ws in packs.items():
            gbs = streamed_gbs(ws, packed_linear, 1, k, ws[0].nbytes, torch.device("cpu"),
                               torch.float32)  # fmt: skip
            cells.append(f"{name} {n}x{k}: {gbs:.1f}")
        print(f"round {r} ({time.strftime('%H:%M:%S')}): " + ", ".join(cells), flush=True)
        time.sleep(2)


if __name__ == "__main__":
    main()
