"""Sweep the quantized-matmul kernel variants over Llama-3-8B linear shapes and token counts.

    python3 benchmarks/gpu_qsweep.py OUT.json [--types Q4_K,Q5_K,Q6_K,Q8_0] [--tokens 1,2,...]
        [--shapes qo,kv,gateup,down,lmhead] [--kernels auto,mm_pipe,...] [--budget 240]

Per type x shape x T every candidate (`candidates`: hetero.kernels.triton_qvariants configs,
plus `auto`, what qlinear runs today, and at T >= 64 `dense`, dequantize + cuBLAS) is run once
eagerly and checked against x @ W^T in float32 (W from the bit-exact dequant kernel), then timed
from CUDA-graph replays over copies of the weight (>= 256 MB, as a model's layers rotate
through L2). Ceilings measured in the same run: copy bandwidth (read + write) and the bf16
matmul rate. Prints the best variant per cell with us, % of the bandwidth roofline (packed
weight bytes / copy bandwidth) and the speedup over `auto`; every number goes to OUT.json.

A failure is recorded per config. Each type runs in a worker process that logs a line before and
after each config; a worker that dies (an illegal address poisons its CUDA context) is replaced
and the sweep resumes after the config it died in. Kernels compile first in parallel processes.
Shapes: the unfused Llama-3-8B linears by default; the fused ones the model loads (qkv, qk,
gateup2) on request. `--kernels` keeps only some kinds of candidate (a re-run of what changed).
The budget (seconds, all included) bounds the run: configs not reached are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qsweep_cells import ALL_SHAPES, RISKY, SHAPES, candidates, cell_jobs, summarize  # noqa: E402

WORKER_TIMEOUT_S = 120  # one type's sweep; a hang (a spin on a split-K counter) is cut here


def _compile_one(job: tuple[str, str, int]) -> str:
    """Compile (run once on a small weight) one variant of one type in a pool process."""
    from qsweep_cells import make_weight, run_candidate

    ggml_type, name, t = job
    try:
        pw = make_weight(ggml_type, 256, 4096)
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        run_candidate(name, x, pw)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported, and the timed run will record it per cell
        return f"{ggml_type} {name} T={t}: {type(e).__name__}: {str(e)[:200]}"


def compile_all(
    types: list[str], tokens: list[int], deadline: float, kernels: frozenset[str] | None = None
) -> None:
    # A variant compiles once per type whatever T (T is a run-time argument), except those
    # whose constexprs follow T: qlinear's own paths and the few-token kernel (4 or 8 tokens).
    seen: dict[tuple[str, int], int] = {}
    for t in sorted(tokens):
        for c in candidates(t, kernels):
            by_t = c in ("auto", "dense") or c.startswith("tokens")
            seen.setdefault((c, t if by_t else 0), t)
    jobs = [(ty, c, t) for (c, _), t in seen.items() for ty in types]
    jobs.sort(key=lambda j: j[1].split(":")[0] in RISKY)  # a crash breaks the pool: risky last
    ctx = multiprocessing.get_context("spawn")
    workers = min(12, os.cpu_count() or 4)
    started = time.time()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futures = [pool.submit(_compile_one, j) for j in jobs]
    errors = []
    for f in futures:
        try:
            err = f.result(timeout=max(1.0, deadline - time.time()))
        except Exception as e:  # a pool process died, or the budget ran out
            err = f"compile: {type(e).__name__}: {e}"
        if err:
            errors.append(err)
    for p in list(getattr(pool, "_processes", {}).values()):  # a hung compile must not block
        p.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"compiled {len(jobs)} (type, variant, T) in {time.time() - started:.0f} s", flush=True)
    for e in errors[:20]:
        print("  compile failure:", e, flush=True)


def _run_worker(ggml_type: str, jobs: list, log: Path, deadline: float) -> int:
    ctx = multiprocessing.get_context("spawn")
    from qsweep_cells import worker

    p = ctx.Process(target=worker, args=(ggml_type, jobs, str(log), deadline))
    p.start()
    p.join(timeout=max(5.0, min(WORKER_TIMEOUT_S, deadline - time.time() + 5)))
    if p.is_alive():
        p.kill()
        p.join()
        return -9
    return p.exitcode or 0


def sweep_type(ggml_type: str, jobs: list, log: Path, deadline: float) -> list[dict]:
    """All jobs of one type, in worker processes, resuming after a config that killed one."""
    rows: list[dict] = []
    todo = list(jobs)
    while todo and time.time() < deadline:
        log.write_text("")
        code = _run_worker(ggml_type, todo, log, deadline)
        lines = [json.loads(s) for s in log.read_text().splitlines() if s.strip()]
        if not lines:  # died before its first config: retrying would do the same
            rows += [{**j[1], "error": f"worker exited {code} before any config"} for j in todo]
            return rows
        done = [r for r in lines if "started" not in r]
        rows += done
        started = [r for r in lines if "started" in r]
        finished = {r["job"] for r in done}
        dead = [r for r in started if r["job"] not in finished]
        for r in dead:  # the config the worker died in
            rows.append({**r["cell"], "error": f"worker died (exit {code}) in this config"})
            finished.add(r["job"])
        todo = [j for j in todo if j[0] not in finished]
        if code == 0 and todo:  # the worker stopped for the budget
            break
    rows += [{**j[1], "error": "skipped: time budget"} for j in todo]
    return rows


def ceilings() -> dict:
    from gpu_qmatmul import copy_bandwidth, matmul_rate

    return {"copy_gbs": copy_bandwidth(), "bf16_tflops": matmul_rate()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON file for every measurement")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--kernels", default="", help="only these kinds, e.g. auto,mm_pipe,gemv_pipe,dense"
    )
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    start = time.time()
    deadline = start + args.budget
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in ALL_SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(ALL_SHAPES)}")
    kernels = frozenset(k.strip() for k in args.kernels.split(",") if k.strip()) or None
    compile_all(types, tokens, start + 0.35 * args.budget, kernels)
    ceil = ceilings()
    print(
        f"copy {ceil['copy_gbs']:.0f} GB/s, bf16 mm {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True
    )
    rows: list[dict] = []
    log = Path(args.out).with_suffix(".log.jsonl")
    for i, ggml_type in enumerate(types):
        share = (deadline - time.time()) / (len(types) - i)  # the time left, split evenly
        jobs = cell_jobs(ggml_type, shapes, tokens, kernels)
        rows += sweep_type(ggml_type, jobs, log, time.time() + share)
    from hetero.kernels.gemv_tuning import arch_of

    arch = arch_of("cuda")
    result = {"ceilings": ceil, "device": torch.cuda.get_device_name(), "arch": arch, "rows": rows}
    result["best"] = summarize(rows, ceil)
    result["seconds"] = time.time() - start
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({len(rows)} measurements, {result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
