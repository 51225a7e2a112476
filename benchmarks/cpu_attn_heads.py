"""The CPU's decode attention GB/s as the profile's calibration reads it, for two head layouts:
the tiny model's (4 query heads over 2 KV heads of 64) and an 8B's (32 over 8 of 128).

    python benchmarks/cpu_attn_heads.py [--threads 0]

The calibration's 6-layer model (profiler/calibrate.py) runs decode steps at one sequence of 16
and of 512 prompt tokens; the KV bytes the longer context adds over the time it adds is the
attention's GB/s (the profile's attn_gbs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hetero.kernels import cpu_threads
from hetero.planner.cost import kv_token_bytes
from hetero.planner.model_desc import from_gguf
from hetero.profiler import calibrate as cal

LAYOUTS = {"tiny (4 over 2 x 64)": {}, "8B (32 over 8 x 128)": cal.CPU_SHAPE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    print("threads", cpu_threads.configure(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in LAYOUTS.items():
            t0 = time.time()
            path = cal._write(Path(tmp), 6, shape)
            engine = cal._engine(path, "cpu", "fp16", 1024)
            try:
                short, long = cal._step_s(engine, 1, cal.PROMPT), cal._step_s(engine, 1, 512)
            finally:
                engine.close()
            kv = 6 * (512 - cal.PROMPT) * kv_token_bytes(from_gguf(str(path)), "fp16")
            print(f"{name}: step {short * 1e3:.3f} ms, +{512 - cal.PROMPT} tokens "
                  f"{(long - short) * 1e3:.3f} ms, {kv / 1e6:.1f} MB: "
                  f"{kv / (long - short) / 1e9:.1f} GB/s ({time.time() - t0:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
