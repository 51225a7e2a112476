"""The host's share of a graphed decode step that is not the scheduler's: filling the decode
graph's static buffers (cuda_graph.DecodeGraphs._fill) and the sampler's per-step tensors
(sampler.make_batch, and the engine's cache of them, sampler.SamplingStates).

    python benchmarks/host_step.py [--device cpu] [--context 512] [--max-model-len 4096]
        [--repeats 2000]

No model runs: a tiny synthetic llama (written to a temporary folder) and a small KV pool give
DecodeGraphs its buffers, and hand-made requests (each `--context` tokens, a block table of its
own) give the steps:

    fill b=1, b=64     a decode step of 1 and 64 sequences (buckets 1 and 64)
    fill mixed 64      31 decodes beside a 33-token prompt chunk in the 64-row bucket of a
                       graph set with max_batch 32 (the prompt rows attend in row tiles)
    make_batch 1, 64   1 and 64 greedy rows, built afresh
    cached 1, 64       the same through the engine's cache (a step after the first)

It prints the median host microseconds of each: the time until the call returns (on a CPU
device the copies are memcpy; on `--device cuda` the call queues the real pinned transfers,
and the device is synchronized after each repeat, outside the timed span).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetero import sampler
from hetero.config import RuntimeConfig
from hetero.engine.request import Request
from hetero.engine.scheduler import ScheduledRequest
from hetero.execution.cuda_graph import DecodeGraphs, bucket_for
from hetero.execution.kv_pool import KVPool
from hetero.kernels.registry import forcing
from hetero.model.llama import load_model
from hetero.sampler import make_batch
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic

BLOCK = 16
SamplingStates = getattr(sampler, "SamplingStates", None)


def median_us(fn, args: tuple, repeats: int, sync) -> float:
    """Median host microseconds of fn(*args); the device is synchronized between calls, outside
    the timed span."""
    for _ in range(20):
        fn(*args)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        sync()
    return statistics.median(times) * 1e6


def decode_rows(n: int, context: int, first: int = 0) -> list[ScheduledRequest]:
    """n sequences decoding their context-th token, each with its own blocks."""
    nb = -(-context // BLOCK)
    out = []
    for i in range(first, first + n):
        req = Request(f"r{i}", [(7 * i + j) % 4000 + 3 for j in range(context)])
        req.block_tables = [list(range(i * nb, (i + 1) * nb))]
        out.append(ScheduledRequest(req, 1, context - 1, False, True))
    return out


def prompt_chunk(m: int, start: int, first_block: int) -> ScheduledRequest:
    req = Request("p", [(5 * j) % 4000 + 3 for j in range(start + m)])
    nb = -(-(start + m) // BLOCK)
    req.block_tables = [list(range(first_block, first_block + nb))]
    return ScheduledRequest(req, m, start, True, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as folder:
        path = write_synthetic(Path(folder) / "tiny.gguf", "tiny-llama", "q8_0", progress=False)
        weights = "fp16" if dev.type == "cpu" else "dense"  # (fp16: the CPU's mode)
        _, model = load_model(path, RuntimeConfig(device=args.device, weights=weights))
    nb = -(-args.context // BLOCK)
    pool = KVPool(model.config, model.config.n_layers, 65 * nb + 8, BLOCK, "fp16", device=dev)
    refs = {} if dev.type == "cuda" else {"kv_write": "torch", "paged_attention": "torch"}
    with forcing(refs):
        decode = DecodeGraphs(model, pool, 64, args.max_model_len)
        mixed = DecodeGraphs(model, pool, 32, args.max_model_len, max_rows=64)
    results = {}
    for b in (1, 64):
        args_ = (decode_rows(b, args.context), bucket_for(b, decode.buckets))
        results[f"fill b={b}"] = median_us(decode._fill, args_, args.repeats, sync)
    sched = [*decode_rows(31, args.context), prompt_chunk(33, 40, 64 * nb)]
    results["fill mixed 64"] = median_us(mixed._fill, (sched, 64), args.repeats, sync)
    greedy = SamplingParams(temperature=0)
    for b in (1, 64):
        rows = ([greedy] * b, [[1]] * b, [[]] * b, [0] * b, dev)
        results[f"make_batch {b}"] = median_us(make_batch, rows, args.repeats, sync)
        if SamplingStates is not None:  # (absent from a tree before the cache: A/B runs)
            states = SamplingStates()
            results[f"cached {b}"] = median_us(states.make, rows, args.repeats, sync)
    for name, us in results.items():
        print(f"{name:16s} {us:8.1f} us")


if __name__ == "__main__":
    main()
