"""`hetero plan`'s prediction against `hetero bench`'s measurement, for the same configuration.

    python benchmarks/plan_vs_bench.py [MODEL] --devices cpu -c 1 -c 16 [--input-len 64]
        [--output-len 64] [--refresh | --refresh-only cpu] [--json OUT.json]

For each concurrency C: profile the devices (cached), plan MODEL over them, run the engine with
the plan's weights mode, KV dtype and KV blocks on C requests arriving together (prompts of
--input-len random tokens, --output-len tokens each), and print predicted against measured:

    decode tok/s per stream   plan: single_stream_tok_s (C = 1) or 1 / the slowest stage's
                              step x micro-batches; bench: 1 / median inter-token latency
    aggregate decode tok/s    plan: aggregate_tok_s; bench: C / median inter-token latency
                              (C sequences in lock step gain C tokens a step)
    TTFT                      plan: ttft_burst_s (C prompts at once); bench: median TTFT

A one-stage plan runs in this process (a GPU share `cuda:0@70%:32GB` in a child process started
with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and the memory cap; an MPS daemon must be running). One GPU
and the CPU are planned, as hetero-serve plans them by itself, to run in one process: the GPU's
first layers (-ngl), its KV blocks and memory cap the plan's, its prompt steps streaming the CPU
layers' weights to the GPU. So a VRAM-capped GPU + CPU split is `--devices
cuda:0@100%:5GB,cpu`. Other plans of several stages run through the pipeline engine (`hetero
bench --plan` does the same): each stage process gets its layers, KV blocks, weights mode and
MPS percentage from the plan, e.g. an MPS pair `--devices cuda:0@70%:32GB,cuda:0@30%:24GB
--use-all-devices`.

Warm-up runs the measured shapes once (graph buckets, kernel compilation, allocator); then
--rounds x C requests are measured, C at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from hetero.cli_plan import in_one_process, plan_config
from hetero.planner.model_desc import describe
from hetero.planner.plan import Plan, plan
from hetero.planner.resolve import resolve_devices
from hetero.planner.shares import is_share, parse_share, share_env
from hetero.profiler.machine import ThisMachine


def _one_stage_engine(model: str, p: Plan, eager: bool, threads: int = 0):
    import torch

    from hetero.config import RuntimeConfig
    from hetero.engine.config import EngineConfig, SchedulerConfig
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine

    (stage,) = p.stages
    device = stage.base_device or stage.device.split("@")[0]
    if is_share(stage.device) and parse_share(stage.device).memory_cap:
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        torch.cuda.set_per_process_memory_fraction(parse_share(stage.device).memory_cap / total)
    cfg = EngineConfig(
        kv_dtype=stage.kv_dtype,
        num_kv_blocks=stage.num_kv_blocks,
        enable_prefix_caching=False,
        speculative="off",  # the cost model prices plain decode steps
        enforce_eager=eager,
        scheduler=SchedulerConfig(max_num_seqs=max(p.concurrency, 1)),
    )
    rt = RuntimeConfig(device=device, weights=stage.weights, threads=threads)
    return build_engine(model, LaunchConfig(cfg, rt))


def _pipeline_engine(model: str, plan_file: str, p: Plan, threads: int = 0):
    """The engine the plan file gives `hetero-serve --plan`: pipeline stages (each stage's KV
    dtype, blocks and weights from the file), or for a plan made to run in one process (a GPU
    and the CPU, as hetero-serve plans by itself) one process with the GPU's first layers
    (-ngl), its KV blocks and memory cap those of the plan's GPU stage."""
    from hetero.config import PipelineConfig, RuntimeConfig
    from hetero.engine.config import EngineConfig, SchedulerConfig
    from hetero.factory import LaunchConfig
    from hetero.launch import build_engine

    # (an in-process plan's GPU memory cap and KV pool: hetero-serve's, set by launch._running)
    cfg = EngineConfig(
        enable_prefix_caching=False,
        speculative="off",  # the cost model prices plain decode steps
        scheduler=SchedulerConfig(max_num_seqs=max(p.concurrency, 1)),
    )
    rt = RuntimeConfig(device=p.stages[0].base_device or "cpu", threads=threads)
    return build_engine(model, LaunchConfig(cfg, rt, PipelineConfig(plan=plan_file)))


def bench_stage(
    model: str, p: Plan, input_len: int, output_len: int, rounds: int = 1, eager: bool = False,
    threads: int = 0,
) -> dict:  # fmt: skip
    """Run the engine as the plan `p` says; decode and TTFT numbers."""
    import torch

    from hetero.bench import run_bench

    with tempfile.TemporaryDirectory(prefix="plan-vs-bench-") as tmp:
        plan_file = os.path.join(tmp, "plan.json")
        with open(plan_file, "w") as f:
            f.write(p.to_json())
        gpu_memory(p, "before the engine")  # what this process held already (a profile)
        if len(p.stages) == 1:
            engine = _one_stage_engine(model, p, eager, threads)
        else:
            engine = _pipeline_engine(model, plan_file, p, threads)
        try:
            c = p.concurrency
            gpu_memory(p, "built")
            run_bench(engine, c, c, input_len, 4, seed=1)  # warm-up at the measured shapes
            gpu_memory(p, "warmed up")
            host_load("measured")  # a busy host reads slow: the row says so
            r = run_bench(engine, rounds * c, c, input_len, output_len, seed=0)
            gpu_memory(p, "measured")
        except torch.OutOfMemoryError:
            gpu_memory(p, "out of memory", census=True)
            raise
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    itl = statistics.median(r.itl_s)
    return {
        "per_stream_tok_s": 1 / itl,
        "aggregate_tok_s": p.concurrency / itl,
        "ttft_s": statistics.median(
            r.ttft_s
        ),  # a hiccup of the host in one request is not the plan's
        "ttft_each_s": list(r.ttft_s),
        "output_tok_s_wall": r.output_tok_s,
    }


def host_load(when: str) -> None:
    """The host's load average and the other processes taking a core or more, as the
    measurement starts (call 1 of the thirteenth session had one row 20% slow throughout)."""
    import psutil

    procs = [q for q in psutil.process_iter(["pid", "name"]) if q.pid != os.getpid()]
    for q in procs:
        try:
            q.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(0.5)
    busy = []
    for q in procs:
        try:
            pct = q.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= 50:
            busy.append(f"{q.info['name']} (pid {q.pid}) {pct:.0f}%")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"host ({when}): load average {load}; busy: {'; '.join(busy) or 'none'}", flush=True)


def gpu_memory(p: Plan, when: str, census: bool = False) -> None:
    """This process's GPU memory against the plan's GPU stage (weights, KV, activations and
    streaming room): allocated now, the peak so far, CUDA graphs' pools; with `census`, the live
    CUDA tensors by shape, largest first (where an overrun sits)."""
    import collections
    import gc

    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gpus = [s for s in p.stages if not (s.base_device or s.device).startswith("cpu")]
    planned = sum(s.weight_bytes + s.kv_bytes + s.activation_bytes for s in gpus)
    mib = [(s.weight_bytes / 2**20, s.kv_bytes / 2**20, s.activation_bytes / 2**20) for s in gpus]
    parts = ", ".join(f"{w:.0f} + {k:.0f} + {a:.0f}" for w, k, a in mib)
    pools = sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("segment_pool_id", (0, 0)) != (0, 0)
    )
    print(
        f"gpu memory ({when}): allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, peak "
        f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, reserved "
        f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB (graph pools {pools / 2**20:.0f} MiB); "
        f"planned weights + KV + activations {planned / 2**20:.0f} MiB "
        f"({parts})",
        flush=True,
    )
    if not census:
        return
    size, count, seen = collections.Counter(), collections.Counter(), set()
    for o in gc.get_objects():
        try:
            if not (isinstance(o, torch.Tensor) and o.is_cuda):
                continue
            st = o.untyped_storage()
        except Exception:  # noqa: BLE001 (objects half torn down)
            continue
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        key = (tuple(o.shape), str(o.dtype).removeprefix("torch."))
        size[key] += st.nbytes()
        count[key] += 1
    print(f"live CUDA storages: {len(seen)}, {sum(size.values()) / 2**20:.0f} MiB; largest:")
    for key, n in size.most_common(25):
        print(f"  {n / 2**20:9.1f} MiB  {count[key]:4d} x {key[0]} {key[1]}")


def bench_in_child(
    model: str, p: Plan, input_len: int, output_len: int, rounds: int, eager: bool, threads: int
) -> dict:
    """The bench in a process started with the share's MPS environment."""
    env = {**os.environ, **share_env(parse_share(p.stages[0].device))}
    args = [sys.executable, __file__, "--child", model, str(input_len), str(output_len)]
    args += [str(rounds), str(int(eager)), str(threads)]
    done = subprocess.run(args, input=p.to_json(), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def predicted(p: Plan) -> dict:
    # C sequences gain a token each a pipeline cycle: one stream's speed is aggregate / C
    per_stream = p.single_stream_tok_s if p.concurrency == 1 else p.aggregate_tok_s / p.concurrency
    return {
        "per_stream_tok_s": per_stream,
        "aggregate_tok_s": p.aggregate_tok_s,
        "ttft_s": p.ttft_burst_s,
    }


def row(c: int, pred: dict, meas: dict) -> str:
    cells = [f"c={c:<3}"]
    for key, unit in (("per_stream_tok_s", "tok/s"), ("aggregate_tok_s", "tok/s"), ("ttft_s", "s")):
        ratio = pred[key] / meas[key]
        cells.append(f"{key} pred {pred[key]:.3g} meas {meas[key]:.3g} {unit} ({ratio:.2f}x)")
    return "  ".join(cells)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("-c", "--concurrency", type=int, action="append")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--use-all-devices", action="store_true")
    ap.add_argument("--weights", default="auto", help="force a weights mode (default: planned)")
    ap.add_argument("--rounds", type=int, default=2, help="measured requests: rounds x C")
    ap.add_argument("--enforce-eager", action="store_true", help="plan for no CUDA graphs")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: the engine's default per stage)"
    )
    ap.add_argument("--refresh", action="store_true", help="profile the machine again first")
    ap.add_argument(
        "--refresh-only",
        action="append",
        default=[],
        help="profile only this device again (cpu, cuda:0), the others' profiles cached",
    )
    ap.add_argument("--json", default=None, help="write every row here")
    return ap.parse_args()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, input_len, output_len, rounds, eager, threads = sys.argv[2], *map(int, sys.argv[3:8])
        p = Plan.from_json(sys.stdin.read())
        meas = bench_stage(model, p, input_len, output_len, rounds, bool(eager), threads)
        print(json.dumps(meas))
        return
    args = parse_args()
    from hetero.models import resolve_model

    model = str(resolve_model(args.model))
    desc = describe(model)
    devices = resolve_devices(
        args.devices.split(","),
        ThisMachine(refresh=args.refresh or bool(args.refresh_only), only=args.refresh_only),
    )
    rows = []
    for c in args.concurrency or [1, 16]:
        cfg = plan_config(
            concurrency=c,
            prompt_len=args.input_len,
            output_len=args.output_len,
            context=args.context or args.input_len + args.output_len + 16,
            use_all_devices=args.use_all_devices,
            weights=args.weights,
            max_num_seqs=c,  # the engine's graph buckets end at C, as the bench's scheduler's
            enforce_eager=args.enforce_eager,
            in_process=in_one_process(devices),  # as hetero-serve plans: one GPU + the CPU
        )
        p = plan(desc, devices, cfg)
        one_share = len(p.stages) == 1 and is_share(p.stages[0].device)
        run = bench_in_child if one_share else bench_stage
        meas = run(
            model, p, args.input_len, args.output_len, args.rounds, args.enforce_eager,
            args.threads,
        )  # fmt: skip
        split = ", ".join(f"{s.device} {s.layer_start}-{s.layer_end - 1}" for s in p.stages)
        print(
            f"c={c}: plan {split}; step ms {[round(s.predicted_step_s * 1e3, 2) for s in p.stages]}"
        )
        for note in p.notes:  # where a streamed CPU layer's prompt time goes, part by part
            if "matmuls on" in note:
                print(f"c={c}: {note}")
        print(row(c, predicted(p), meas), flush=True)
        rows.append({"concurrency": c, "predicted": predicted(p), "measured": meas,
                     "plan": json.loads(p.to_json())})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
