"""Where a decode step's device time goes: each kernel's time a step, at a few batch sizes.

    python benchmarks/gpu_step_profile.py MODEL.gguf [--batches 1,64] [--steps 8]
        [--context 512] [--prefill 512] [--top 25] [--device cuda] [--unfused [all|rope]]

Builds the engine as benchmarks/gpu_engine.py does, lets B requests of --context prompt tokens
reach decode, then records --steps decode steps under torch.profiler twice:

- eager (the step's kernels one by one): each kernel's device time a step, summed by name,
  and the share of the step the kernels fill (the rest is the host's launch gaps);
- through the CUDA graphs (the engine's normal path), the wall time a step, which the kernels'
  sum above bounds from below: what is left is what fusing or faster kernels can win.

--prefill P does the same for a step that prefills one request of P tokens. --unfused profiles
the decode step as before its fusions (gpu_engine.py's `unfuse`): the two, kernel by kernel.

Also the copy ceiling three ways (a D2D copy timed with events, the same copy replayed from a
CUDA graph, and a read-only reduction), since the graph-replayed copy has read lower than the
others on this machine kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_qmatmul import copy_pair, event_time, graph_time  # noqa: E402

from hetero.bench_workloads import make_prompts  # noqa: E402
from hetero.config import RuntimeConfig  # noqa: E402
from hetero.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from hetero.engine.engine import Engine  # noqa: E402
from hetero.factory import LaunchConfig  # noqa: E402
from hetero.launch import build_engine  # noqa: E402
from hetero.sampling import SamplingParams  # noqa: E402


def copy_ceilings(nbytes: int = 4 << 30) -> dict[str, float]:
    """GB/s (bytes read + written, or read for the reduction) of three ways to stream memory."""
    src, dst = copy_pair(nbytes)
    graphed = min(graph_time([lambda: dst.copy_(src)], 10) for _ in range(3))
    return {
        "copy_events": 2 * nbytes / event_time(lambda: dst.copy_(src), 10) / 1e9,
        "copy_graph": 2 * nbytes / graphed / 1e9,
        "sum_events": nbytes / event_time(src.sum, 10) / 1e9,
    }


def _kernel_times(prof, steps: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (device seconds a step, launches a step)} from a profile of `steps` steps."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc[e.name]
            a[0] += e.device_time / 1e6
            a[1] += 1
    return {k: (v[0] / steps, v[1] // steps) for k, v in acc.items()}


def to_decode(engine: Engine, batch: int, context: int) -> None:
    """B requests of `context` random prompt tokens, stepped until every one is decoding."""
    prompts = make_prompts(engine, "random", batch, context, 0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{batch}-{i}", p, params)
    while len(engine.scheduler.decoding()) < batch:
        engine.step()
    for _ in range(3):  # warm: the decode shapes compiled and captured
        engine.step()


def _report(title: str, graph_s: float, eager_s: float, runs: dict, top: int) -> None:
    """runs: {"graph": kernel times, "eager": kernel times} (the graph's are empty where the
    profiler does not see kernels launched by a graph replay)."""
    print(
        f"\n{title}: graph step {graph_s * 1e3:.3f} ms, eager step {eager_s * 1e3:.3f} ms "
        "under the profiler"
    )
    for path, times in runs.items():
        total = sum(t for t, _ in times.values())
        launches = sum(n for _, n in times.values())
        print(f" {path}: kernels {total * 1e3:.3f} ms a step in {launches} launches")
        for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {t * 1e6:9.1f} us {t / max(total, 1e-12):6.1%} {n:4d}x  {name[:110]}")


def _profiled(steps: int, each, sync) -> tuple[float, dict]:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            each()
        sync()
    return (time.perf_counter() - t0) / steps, _kernel_times(prof, steps)


def _syncer(dev: torch.device):
    """A call that waits for dev's work (nothing to wait for on a CPU)."""
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def _timed_steps(engine: Engine, steps: int, each, dev) -> tuple[float, float, dict]:
    """(median graph-path seconds of `each()`, eager seconds under the profiler, kernel times
    of both paths): each() runs one step's worth of work and returns the seconds it timed."""
    sync = _syncer(dev)
    graph_s = statistics.median(each() for _ in range(steps))
    _, graph_times = _profiled(steps, each, sync)
    runner = engine.executor.runner
    graphs, runner.graphs = runner.graphs, None  # eager: kernels one by one
    each()
    eager_s, eager_times = _profiled(steps, each, sync)
    runner.graphs = graphs
    return graph_s, eager_s, {"graph": graph_times, "eager": eager_times}


def _synced_step(engine: Engine, dev) -> float:
    sync = _syncer(dev)
    sync()
    t0 = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - t0


def profile_batch(engine: Engine, batch: int, context: int, steps: int, top: int) -> None:
    to_decode(engine, batch, context)
    dev = torch.device(engine.executor.info.device)
    times = _timed_steps(engine, steps, lambda: _synced_step(engine, dev), dev)
    _report(f"B={batch} context {context}", *times, top)
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()


def profile_prefill(engine: Engine, length: int, steps: int, top: int) -> None:
    """One request of `length` prompt tokens and one output token: its prefill step."""
    dev = torch.device(engine.executor.info.device)
    prompt = make_prompts(engine, "random", 1, length, 1)[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    count = iter(range(1 << 30))

    def one() -> float:
        engine.add_request(f"prefill-{next(count)}", prompt, params)
        sec = _synced_step(engine, dev)
        while engine.has_unfinished():
            engine.step()
        return sec

    one()  # warm: this length's shapes
    _report(f"prefill {length}", *_timed_steps(engine, steps, one, dev), top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", default="", help="prompt lengths to profile a prefill of")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "fp16", "bf16"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--unfused", nargs="?", const="all", choices=["all", "rope"])
    args = ap.parse_args()
    if args.unfused:
        from gpu_engine import unfuse

        unfuse(args.unfused)
    batches = [int(x) for x in args.batches.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    if args.device.startswith("cuda"):
        print("ceilings GB/s:", {k: round(v) for k, v in copy_ceilings().items()}, flush=True)
    sched = SchedulerConfig(
        max_num_seqs=max(batches), max_num_batched_tokens=max([2048, *prefills]),
        max_model_len=max([args.context + 64 + 4 * args.steps, *prefills]) + 16,
    )  # fmt: skip
    cfg = EngineConfig(
        kv_dtype=args.kv_dtype, scheduler=sched, enable_prefix_caching=False, speculative="off",
        overlap_schedule="off",  # a step's kernels alone, each step synced
    )  # fmt: skip
    rt = RuntimeConfig(device=args.device, weights="quant")
    engine = build_engine(args.model, LaunchConfig(cfg, rt))
    for b in batches:
        profile_batch(engine, b, args.context, args.steps, args.top)
    for p in prefills:
        profile_prefill(engine, p, args.steps, args.top)


if __name__ == "__main__":
    main()
