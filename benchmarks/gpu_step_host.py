"""Where a decode step's time goes outside the kernels: the host's share of each step, phase by
phase, against the device's time.

    python benchmarks/gpu_step_host.py MODEL.gguf [--batches 1,64] [--steps 50] [--context 512]
        [--json OUT.json]

BENCHMARKS.md's profile put ~0.8 ms of the 4.7 ms batch-1 Q4_K_M step (Llama-3-8B) outside the
kernels. Two things sit there: the gaps between the ~440 kernels the decode graph replays (a
graph node's launch latency, ~1-2 us each), and the host's serial work between replays, while
the GPU idles: the scheduler, filling the graph's static buffers (tensors built on the host and
copied to the device one by one), the sampler (its per-step parameter tensors, a copy each),
`.tolist()` (the step's one sync) and the postprocessing.

This wraps the engine's phases with timers (the engine's code is not changed): host seconds of
each phase (perf_counter), and device seconds of the graph replay and of the sampler (CUDA
events). Per batch size it prints the median of each over --steps decode steps:

    wall              engine.step(), synced
    graph_gpu         the decode graph's device time (its kernels and the gaps between them)
    host phases       schedule, fill (static buffers), replay (the launch call), sample_host
                      (make_batch, the sampler's launches, tolist), update
    exposed           wall - graph_gpu - sampler_gpu: what the GPU spends idle each step

With --overlap-schedule on the steps are not synced (each step's host work runs while the next
step's graph does): wall is then what a step takes in the stream of steps, and exposed what
is left of the host's time (sample_host and tolist are the plain step's phases: absent).

Compare graph_gpu with gpu_step_profile.py's kernel sum to split in-graph gaps from kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_step import profiled  # noqa: E402
from gpu_step_profile import to_decode  # noqa: E402

from hetero.config import RuntimeConfig  # noqa: E402
from hetero.engine import engine as engine_mod  # noqa: E402
from hetero.engine import step_sampling  # noqa: E402
from hetero.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from hetero.engine.engine import Engine  # noqa: E402
from hetero.factory import LaunchConfig  # noqa: E402
from hetero.launch import build_engine  # noqa: E402


class PhaseTimer:
    """Host seconds of wrapped calls, and device seconds between recorded event pairs."""

    def __init__(self) -> None:
        self.host: dict[str, list[float]] = defaultdict(list)
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    def wrap(self, owner, attr: str, name: str, device_time: bool = False) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            pair = None
            if device_time:
                pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                pair[0].record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.host[name].append(time.perf_counter() - t0)
            if pair is not None:
                pair[1].record()
                self.events[name].append(pair)
            return out

        setattr(owner, attr, timed)

    def device(self, name: str) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in self.events[name]]

    def clear(self) -> None:
        self.host.clear()
        self.events.clear()


def instrument(engine: Engine, timer: PhaseTimer) -> None:
    runner = engine.executor.runner
    graphs = runner.graphs
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update", "update")
    timer.wrap(engine_mod, "sample_logits", "sample_host")
    timer.wrap(engine, "sampler", "sampler", device_time=True)  # (a call, not a method lookup)
    timer.wrap(engine.sampling_states, "make", "make_batch")  # make_batch, or its kept state
    timer.wrap(step_sampling, "sampled_lists", "tolist")
    if graphs is None:
        timer.wrap(runner, "run", "eager_forward", device_time=True)
        return
    timer.wrap(graphs, "_fill", "fill")
    for g in graphs.graphs.values():  # each bucket's graph: its launch and device time
        timer.wrap(g, "replay", "replay", device_time=True)


def measure(
    engine: Engine, timer: PhaseTimer, batch: int, context: int, steps: int
) -> dict[str, float]:
    to_decode(engine, batch, context)
    timer.clear()
    walls = []
    sync = torch.cuda.synchronize if not engine.overlap else (lambda: None)
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        walls.append(time.perf_counter() - t0)
    med = {"wall": statistics.median(walls)}
    for name, vals in timer.host.items():
        med[name] = statistics.median(vals)
    for name in timer.events:
        med[name + "_gpu"] = statistics.median(timer.device(name))
    gpu = med.get("replay_gpu", med.get("eager_forward_gpu", 0.0)) + med.get("sampler_gpu", 0.0)
    med["exposed"] = med["wall"] - gpu
    drain(engine)
    return med


def drain(engine: Engine) -> None:
    """Abort the running requests and step until the engine holds none."""
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()


def profiled_steps(engine: Engine, batch: int, context: int, steps: int, top: int) -> None:
    """Decode steps under cProfile (host time inflates; the shares are what it tells)."""
    to_decode(engine, batch, context)
    with profiled(top, f"B={batch}, {steps} steps", ("tottime", "cumulative")):
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    drain(engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "fp16", "bf16"])
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--overlap-schedule", default="off", choices=["off", "on"],
        help="on: overlapped steps (engine/overlap.py), timed unsynced: a step's wall is then "
        "what the stream of steps takes a step, the host's work hidden where it fits",
    )  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, help="then --steps more steps under "
                    "cProfile: the N functions of most own time")  # fmt: skip
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    sched = SchedulerConfig(
        max_num_seqs=max(batches), max_num_batched_tokens=2048,
        max_model_len=args.context + 64 + 2 * args.steps + 16,
    )  # fmt: skip
    cfg = EngineConfig(
        kv_dtype=args.kv_dtype, scheduler=sched, enable_prefix_caching=False, speculative="off",
        overlap_schedule=args.overlap_schedule,
    )  # fmt: skip
    rt = RuntimeConfig(device="cuda", weights="quant")
    engine = build_engine(args.model, LaunchConfig(cfg, rt))
    timer = PhaseTimer()
    instrument(engine, timer)
    results = {}
    for b in batches:
        med = measure(engine, timer, b, args.context, args.steps)
        results[b] = med
        print(f"B={b}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in med.items()), flush=True)
        if args.profile:
            profiled_steps(engine, b, args.context, args.steps, args.profile)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
