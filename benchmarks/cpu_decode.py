"""Engine decode steps on the CPU: the small-op kernels and the KV dtype, compared side by side.

    python benchmarks/cpu_decode.py --streams 1 --steps 30 [--threads 2] [--model FILE]
        [--variants cpu/fp16/qdot,cpu/fp16/fp16]

Each variant is a whole engine (the default model, 64-token prompts, greedy) whose decode steps
run in turns with the others' in one process, so a busy machine slows all of them alike. Per
variant: wall and process-CPU ms per step (min and median), and decode tok/s from the median
wall time. Variants KIND/KV[/WEIGHTS]: the kernel registry's references ("ref") or its CPU
versions ("cpu", kernels/cpu_ops.py), with fp8, fp16 or fp32 KV, and a `--weights` mode (default:
auto).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch

import hetero.execution.kv_pool as kv_cache_mod
import hetero.execution.runner as runner_mod
import hetero.model.layers as layers_mod
import hetero.model.llama as llama_mod
from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.engine.engine import Engine
from hetero.factory import LaunchConfig
from hetero.kernels import reference
from hetero.launch import build_engine
from hetero.model.llama import load_model
from hetero.models import resolve_model
from hetero.sampling import SamplingParams

VARIANTS = ("cpu/fp16/fp16", "cpu/fp16/qdot")
_SELECTING = (runner_mod, layers_mod, kv_cache_mod, llama_mod)  # modules that call select()


@contextlib.contextmanager
def kernels(kind: str):
    """Within: select() gives the references ("ref") or what the registry picks ("cpu")."""
    saved = [(m, m.select) for m in _SELECTING]
    if kind == "ref":
        for m in _SELECTING:
            m.select = lambda op, device: reference(op)
    try:
        yield
    finally:
        for m, fn in saved:
            m.select = fn


def build(variant: str, path, args) -> Engine:
    kind, kv, weights = (variant + "/auto").split("/")[:3]
    with kernels(kind):
        loaded = load_model(path, RuntimeConfig(threads=args.threads, weights=weights))
        cfg = EngineConfig(num_kv_blocks=1024, kv_dtype=kv, speculative="off")  # plain decode steps
        engine = build_engine(None, LaunchConfig(cfg), loaded=loaded)
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
        for i in range(args.streams):
            engine.add_request(f"r{i}", [rng.randrange(1000, 40000) for _ in range(64)], params)
        engine.step()  # the prefill of every stream
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    path = resolve_model(args.model)
    engines = {v: build(v, path, args) for v in args.variants.split(",")}
    wall: dict[str, list[float]] = {v: [] for v in engines}
    cpu: dict[str, list[float]] = {v: [] for v in engines}
    for _ in range(args.steps):
        for v, engine in engines.items():
            with kernels(v.split("/")[0]):
                t, p = time.perf_counter(), time.process_time()
                engine.step()
                wall[v].append(time.perf_counter() - t)
                cpu[v].append(time.process_time() - p)
    print(f"{args.streams} streams, {torch.get_num_threads()} threads, {args.steps} steps")
    for v in engines:
        w, c = statistics.median(wall[v]), statistics.median(cpu[v])
        print(
            f"{v:13s} wall ms/step min {min(wall[v]) * 1e3:7.1f} p50 {w * 1e3:7.1f} | "
            f"cpu min {min(cpu[v]) * 1e3:7.1f} p50 {c * 1e3:7.1f} | "
            f"{args.streams / w:6.1f} tok/s"
        )


if __name__ == "__main__":
    main()
