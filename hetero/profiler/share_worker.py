"""Child process that measures one GPU, whole or an MPS share, and prints its profile.

A whole GPU (`hetero profile`, or hetero-serve's first start) is measured here so that nothing of
the measurement stays in the process that serves next: its CUDA graphs' pools, the rates' weights
that kernel caches keep, the small engines of the calibration (on the H200 0.8 GiB was still
held after an in-process profile, and the capped engine planned next ran out of memory).

A share (`hetero profile --share SPEC`) is started with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set (the
SM share applies from CUDA's first call); the memory cap is set here as torch's per-process
fraction before anything is allocated.

    python -m hetero.profiler.share_worker cuda:0              -> one JSON line on stdout
    python -m hetero.profiler.share_worker cuda:0@70%:32GB     -> the same, for the share
"""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from hetero.planner.shares import is_share, parse_share
from hetero.profiler.calibrate import calibrate
from hetero.profiler.gpu import measure_gpu
from hetero.profiler.machine import live_devices


def main(spec: str) -> None:
    share = parse_share(spec) if is_share(spec) else None
    base = share.base if share else spec
    gpus = [d for d in live_devices() if d.kind == "cuda"]
    live = next((d for d in gpus if d.id == base), None)
    if live is None:
        raise SystemExit(f"{base} is not present (present: {[d.id for d in gpus]})")
    if share and share.memory_cap:
        frac = min(share.memory_cap / live.memory_total, 1.0)
        torch.cuda.set_per_process_memory_fraction(frac, torch.device(live.id))
    with tqdm(total=5, desc=f"profiling {spec}", file=sys.stderr) as bar:
        prof = measure_gpu(live, gpus, bar)
        prof = prof.replace(**calibrate(prof, live.id, "fp8" if prof.fp8_kv else "fp16", bar))
    if share is None:
        print(json.dumps(prof.to_dict()))
        return
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
