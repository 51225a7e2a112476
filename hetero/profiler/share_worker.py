"""Child process of `hetero profile --share SPEC`: measure one MPS share, print its profile.

Started with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set (the SM share applies from CUDA's first call);
the memory cap is set here as torch's per-process fraction before anything is allocated.

    python -m hetero.profiler.share_worker cuda:0@70%:32GB   -> one JSON line on stdout
"""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from hetero.planner.shares import parse_share
from hetero.profiler.calibrate import calibrate
from hetero.profiler.gpu import measure_gpu
from hetero.profiler.machine import live_devices


def main(spec: str) -> None:

    share = parse_share(spec)
    gpus = [d for d in live_devices() if d.kind == "cuda"]
    live = next((d for d in gpus if d.id == share.base), None)
    if live is None:
        raise SystemExit(f"{share.base} is not present (present: {[d.id for d in gpus]})")
    if share.memory_cap:
        frac = min(share.memory_cap / live.memory_total, 1.0)
        torch.cuda.set_per_process_memory_fraction(frac, torch.device(live.id))
    with tqdm(total=5, desc=f"profiling {share.id}", file=sys.stderr) as bar:
        prof = measure_gpu(live, gpus, bar)
        prof = prof.replace(**calibrate(prof, live.id, "fp8" if prof.fp8_kv else "fp16", bar))
    prof = prof.replace(
        id=share.id,
        name=f"{live.name} ({share.percent:g}% of SMs, MPS)",
        sm_share=share.fraction,
        memory_cap=share.memory_cap,
        source="measured",
    )
    print(json.dumps(prof.to_dict()))


if __name__ == "__main__":
    main(sys.argv[1])
