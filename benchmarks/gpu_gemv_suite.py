"""Single-token decode GEMV on one GPU: every Stream-K variant checked and timed against the
kernel qlinear runs today, in one run.

    python benchmarks/gpu_gemv_suite.py OUTDIR [--types Q4_K,Q6_K,Q5_K,Q8_0,Q4_0]
        [--shapes qo,kv,qk,gateup,gateup2,down,lmhead] [--budget 420] [--quick]

1. Ceilings in the same run: a 4 GiB device-to-device copy (bytes read + written) and a
   read-only reduction, timed with events.
2. Kernels compile first, in parallel processes (into Triton's on-disk cache).
3. Per GGUF type x Llama-3-8B linear shape (W [N, K], random blocks, packed in the "bytes"
   arrangement; the baseline also in qlinear's own "fields" one), every variant:
   - correctness: fresh bf16 x, the output's memory poisoned with NaN first (a buffer of the
     output's size filled and freed, which the caching allocator hands out again), compared
     with x @ W^T in float32 (W from the bit-exact dequant kernel) within the bf16 bound of
     tests/test_triton_qmatmul.assert_close, and run twice for the same bits;
   - speed: CUDA-graph replays over copies of the weight (>= 256 MB, as a model's layers pass
     through L2), us per call, GB/s of packed bytes and the fraction of the copy ceiling. The
     integer kernels are timed without their activation quantizer (`xquant`, timed apart:
     one small launch a distinct input, or fused into the norm before it).
4. The ops that feed the integer kernels (norm, SiLU; fused with the quantizer and not), and
   qlinear's batched paths (tensor cores T = 16, 64; dequantize) on both high-plane
   arrangements, Q6_K and Q5_K: us per call.
5. OUTDIR/gemv_results.json: every row; OUTDIR/winners.json: the fastest correct config per
   type and shape (kernels/gemv_tuning.py's table format: check it in as
   kernels/gemv_tuning_<arch>.json); a summary on stdout, with the Llama-3-8B step's GEMV time
   (Q4_K_M's mix and Q6_K) summed from the winners against the baseline.

A config that fails to compile or run is recorded and skipped; the budget (seconds, all
included) bounds the run: cells not reached are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gemv_suite_cells import (  # noqa: E402
    SHAPES,
    Variant,
    bench_cell,
    bench_layouts,
    bench_ops,
    compile_jobs,
    model_step_us,
    run_compile_job,
    winners,
)
from gpu_qmatmul import copy_pair, event_time  # noqa: E402

DEFAULT_TYPES = "Q4_K,Q6_K,Q5_K,Q8_0,Q4_0"


def ceilings() -> dict[str, float]:
    src, dst = copy_pair()
    return {
        "copy_gbps": 2 * src.nbytes / event_time(lambda: dst.copy_(src), 10) / 1e9,
        "read_gbps": src.nbytes / event_time(src.sum, 10) / 1e9,
    }


def environment() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    return {
        "device": p.name, "arch": f"sm_{major}{minor}", "sms": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip


def compile_all(types: list[str], variants: list[Variant], deadline: float) -> list[str]:
    """Compile every (type, variant) in spawned processes; returns the failures."""
    jobs = compile_jobs(types, variants)
    ctx = multiprocessing.get_context("spawn")
    failures, done = [], 0
    pool = ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=ctx)
    try:
        for err in pool.map(run_compile_job, jobs, timeout=max(30.0, deadline - time.time())):
            done += 1
            if err:
                failures.append(err)
                print("compile failure:", err, flush=True)
    except TimeoutError:  # the rest compile at their first launch in the timed run
        print(f"compile deadline: {len(jobs) - done} of {len(jobs)} jobs left", flush=True)
        for proc in list(pool._processes.values()):  # no worker may launch while we time
            proc.terminate()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    print(f"compiled {done} of {len(jobs)} kernels in parallel, {len(failures)} failed", flush=True)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--quick", action="store_true", help="a few variants: a smoke run")
    args = ap.parse_args()
    start = time.time()
    deadline = start + args.budget
    args.outdir.mkdir(parents=True, exist_ok=True)
    from gemv_suite_cells import all_variants

    types, shapes = args.types.split(","), args.shapes.split(",")
    variants = all_variants(args.quick)
    env = environment()
    print(json.dumps(env), flush=True)
    ceil = ceilings()
    print("ceilings GB/s:", {k: round(v) for k, v in ceil.items()}, flush=True)
    failures = compile_all(types, variants, start + args.budget / 3)
    ops = bench_ops()
    ops += bench_layouts([t for t in types if t in ("Q6_K", "Q5_K")])
    rows, skipped = [], []
    for ggml_type in types:
        for shape in shapes:
            if time.time() > deadline - 5:
                skipped.append(f"{ggml_type} {shape}")
                continue
            rows += bench_cell(ggml_type, shape, variants, ceil["copy_gbps"], deadline)
            _save(args.outdir, env, ceil, rows + ops, skipped, failures)
    table = winners(rows, env, ceil)
    (args.outdir / "winners.json").write_text(json.dumps(table, indent=1))
    _save(args.outdir, env, ceil, rows + ops, skipped, failures)
    _summary(rows, table, ceil, skipped)
    print(f"done in {time.time() - start:.0f} s; wrote {args.outdir}/gemv_results.json, "
          f"{args.outdir}/winners.json", flush=True)  # fmt: skip


def _save(outdir: Path, env, ceil, rows, skipped, failures) -> None:
    doc = {"env": env, "ceilings": ceil, "rows": rows, "skipped": skipped, "compile": failures}
    (outdir / "gemv_results.json").write_text(json.dumps(doc, indent=1))


def _summary(rows: list[dict], table: dict, ceil: dict, skipped: list[str]) -> None:
    base = {(r["type"], r["shape"]): r for r in rows if r["variant"] == "auto" and r.get("us")}
    print("\ntype  shape              N x K           baseline us (GB/s)   best us (GB/s, % copy)  "
          "speedup  best variant")  # fmt: skip
    for e in table["entries"]:
        b = base.get((e["type"], e["shape"]))
        bus = f"{b['us']:8.1f} ({b['gbps']:5.0f})" if b else " " * 15
        sp = f"{b['us'] / e['us']:5.2f}x" if b else "     "
        print(f"{e['type']:5} {e['shape']:18} {e['n']:6d} x {e['k']:5d}  {bus}     "
              f"{e['us']:8.1f} ({e['gbps']:5.0f}, {e['gbps'] / ceil['copy_gbps']:4.0%})  "
              f"{sp}  {e['variant']}")  # fmt: skip
    bad = [r for r in rows if r.get("error")]
    print(f"\n{len(bad)} of {len(rows)} variant runs failed (correctness or launch):")
    for r in bad[:40]:
        print(f"  {r['type']} {r['shape']} {r['variant']}: {r['error'][:160]}")
    for name, est in model_step_us(rows, table).items():
        print(f"Llama-3-8B {name}: GEMVs of one token {est['best_us'] / 1e3:.3f} ms with the "
              f"winners (+ {est['xquant_us'] / 1e3:.3f} ms of xquant) vs {est['base_us'] / 1e3:.3f}"
              f" ms baseline; weights {est['bytes'] / 1e9:.2f} GB -> roofline "
              f"{est['bytes'] / ceil['copy_gbps'] / 1e6:.3f} ms")  # fmt: skip
    if skipped:
        print("skipped (budget):", ", ".join(skipped))


if __name__ == "__main__":
    main()
