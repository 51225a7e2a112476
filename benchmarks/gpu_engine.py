"""The engine on one GPU against its rooflines: decode at several batch sizes, prefill lengths.

    python benchmarks/gpu_engine.py MODEL.gguf [--batches 1,8,32,64] [--prefill 512,4096]
        [--weights quant] [--kv-dtype fp8] [--enforce-eager] [--json OUT.json]
        [--unfused [all|rope]] [--speculative auto] [--overlap-schedule auto] [--overlap-ab]

Loads the model once (weights kept in GGUF blocks: the Triton kernels), then measures in the
same run as the ceilings:

- copy bandwidth (device-to-device, read + written bytes) and the bf16 matmul rate (torch.mm
  8192^3), as benchmarks/gpu_qmatmul.py measures them;
- decode at batch B: B requests of 512 prompt + 128 output tokens started together; a stream's
  speed is 1 / median inter-token latency, the aggregate B times that. Roofline: one decode step
  reads every weight once (the token embedding only its rows) plus the batch's KV, so steps/s <=
  bandwidth / bytes a step;
- prefill of P tokens: one request of P prompt tokens and 1 output; tok/s = P / TTFT. Roofline:
  2 * (linear parameters) * P + the causal attention's 2 * 2 * P^2 / 2 * H * D * layers FLOPs
  over the matmul rate.

With --overlap-ab each decode row is timed with the engine's steps plain
and overlapped (engine/overlap.py), alternated run by run on the one loaded engine, and both
medians reported (the step's host work hidden or not, nothing else changed).

Before timing, a warm-up runs every measured path once (`warm_up`); each row is then run
--repeats times (3) and the median reported, with every run's figure beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_qmatmul import copy_bandwidth, matmul_rate  # noqa: E402

from hetero.bench import run_bench  # noqa: E402
from hetero.config import RuntimeConfig  # noqa: E402
from hetero.engine.config import EngineConfig, SchedulerConfig  # noqa: E402
from hetero.engine.engine import Engine  # noqa: E402
from hetero.execution.kv_pool import block_bytes  # noqa: E402
from hetero.factory import LaunchConfig  # noqa: E402
from hetero.gguf_loader import load_gguf  # noqa: E402
from hetero.kernels.registry import chosen  # noqa: E402
from hetero.launch import build_engine  # noqa: E402

DECODE_IN, DECODE_OUT = 512, 128  # the aggregate target: 64 sequences of 512 + 128


def weight_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes a decode step reads: every tensor but the embedding table, linear parameters)."""
    read, params = 0, 0
    for name, t in load_gguf(engine.executor.model_path).tensors.items():
        if name == "token_embd.weight" and not engine.model_config.tied_embeddings:
            continue
        read += t.nbytes
        if len(t.shape) == 2:
            params += t.shape[0] * t.shape[1]
    return read, params


def decode_row(engine: Engine, batch: int, copy_gbs: float, step_bytes: int, repeats: int) -> dict:
    runs = [run_bench(engine, batch, batch, DECODE_IN, DECODE_OUT) for _ in range(repeats)]
    # (a median of 0: tokens delivered together, as run_bench's own summary allows for)
    itls = [statistics.median(r.itl_s) or statistics.fmean(r.itl_s) for r in runs]
    itl = statistics.median(itls)  # the median run's median inter-token latency
    r = runs[sorted(range(len(itls)), key=itls.__getitem__)[len(itls) // 2]]  # that run
    cfg = engine.model_config
    n_layers = len(engine.executor.model.layer_range)
    kv = batch * (DECODE_IN + DECODE_OUT / 2) / engine.config.block_size
    kv_bytes = kv * block_bytes(cfg, n_layers, engine.config.block_size, engine.config.kv_dtype)
    roof_steps = copy_gbs * 1e9 / (step_bytes + kv_bytes)
    return {
        "batch": batch,
        "stream_tok_s": 1 / itl,
        "aggregate_tok_s": batch / itl,
        "wall_output_tok_s": r.output_tok_s,
        "roofline_tok_s": roof_steps * batch,
        "fraction": (1 / itl) / roof_steps,
        "runs_stream_tok_s": [1 / x for x in itls],
    }


def overlap_rows(engine: Engine, batch: int, copy_gbs: float, step_bytes: int, repeats: int):
    """decode_row with the steps plain, then overlapped, alternated `repeats` times (one run
    each a time) on the one engine: {"plain": row, "overlap": row}, each of its runs' medians."""
    runs: dict[str, list[dict]] = {"plain": [], "overlap": []}
    for _ in range(repeats):
        for name, on in (("plain", False), ("overlap", True)):
            engine.overlap = on  # between runs: no step in flight
            runs[name].append(decode_row(engine, batch, copy_gbs, step_bytes, 1))
    engine.overlap = engine._overlaps()
    out = {}
    for name, rs in runs.items():
        rs.sort(key=lambda d: d["stream_tok_s"])
        row = dict(rs[len(rs) // 2])
        row["runs_stream_tok_s"] = [d["stream_tok_s"] for d in runs[name]]
        out[name] = row
    return out


def prefill_row(engine: Engine, length: int, tflops: float, params: int, repeats: int) -> dict:
    ttfts = [run_bench(engine, 1, 1, length, 1).ttft_s[0] for _ in range(repeats)]
    cfg = engine.model_config
    attn = 2 * length * length * cfg.n_heads * cfg.head_dim * len(engine.executor.model.layer_range)
    flops = 2 * params * length + attn
    ttft = statistics.median(ttfts)
    return {
        "tokens": length,
        "tok_s": length / ttft,
        "runs_tok_s": [length / t for t in ttfts],
        "tflops": flops / ttft / 1e12,
        "fraction": flops / ttft / (tflops * 1e12),
    }


def warm_up(engine: Engine, args) -> None:
    """Every path the timed runs take, once: Triton compiles a kernel per constexpr set (the
    tensor-core tiles follow T), cuBLAS picks its algorithms per shape, and the allocator grows
    to the largest step. Prefill at each measured length (a warm-up that stopped at 128 tokens
    left the first 512- and 4096-token prefills to pay for it), decode at the largest batch."""
    t0 = time.perf_counter()
    run_bench(engine, 2, 2, 64, 8)
    for p in args.prefill:
        run_bench(engine, 1, 1, p, 1)
    if args.batches:
        run_bench(engine, max(args.batches), max(args.batches), DECODE_IN, 8)
    print(f"warmed up in {time.perf_counter() - t0:.1f} s", flush=True)


def _spread(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def make_engine(args) -> Engine:
    longest = max([DECODE_IN + DECODE_OUT] + args.prefill) + 16
    sched = SchedulerConfig(
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(args.prefill + [2048]),
        max_model_len=longest,
    )
    cfg = EngineConfig(
        kv_dtype=args.kv_dtype, scheduler=sched, enforce_eager=args.enforce_eager,
        enable_prefix_caching=False, speculative=args.speculative,
        overlap_schedule=args.overlap_schedule,
    )  # fmt: skip
    rt = RuntimeConfig(device=args.device, weights=args.weights)
    t0 = time.perf_counter()
    engine = build_engine(args.model, LaunchConfig(cfg, rt), progress=True)
    print(f"loaded + captured in {time.perf_counter() - t0:.1f} s; {engine.describe_kv()}")
    return engine


def unfuse(what: str = "all") -> None:
    """The decode step's launches as before they were fused, to time the fusions against:
    "rope": PagedAttention without its fused rotation (so the rope kernel, the KV write and the
    plain attention run, and the output projection quantizes its own input); "all": that, and
    the attention's splits merged by the reduce kernel."""
    import functools

    from hetero.execution.runner import PagedAttention
    from hetero.kernels import triton_paged as tp

    PagedAttention.rope_attend = lambda self, *args, **kwargs: None
    if what == "all":
        tp.paged_decode = functools.partial(tp.paged_decode, merge=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--weights", default="quant", choices=["quant", "dense"])
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "fp16", "bf16"])
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs a row; the median is reported")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script only")
    ap.add_argument(
        "--unfused", nargs="?", const="all", choices=["all", "rope"],
        help="the decode step as before its fusions: the rotation, the KV write, the attention, "
        "its reduce kernel and the output's quantization in launches of their own (rope: the "
        "splits still merged in the attention kernel)",
    )  # fmt: skip
    ap.add_argument("--speculative", default="auto", choices=["auto", "ngram", "off"])
    ap.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"])
    ap.add_argument(
        "--overlap-ab", action="store_true",
        help="each decode row plain and overlapped, alternated (with speculation: overlapped "
        "between guesses)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.unfused:
        unfuse(args.unfused)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    on_gpu = args.device.startswith("cuda")
    copy_gbs, tflops = (copy_bandwidth(), matmul_rate()) if on_gpu else (float("nan"),) * 2
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    engine = make_engine(args)
    print("kernels:", ", ".join(f"{k}={v}" for k, v in chosen(torch.device(args.device)).items()))
    graphs = (
        engine.executor.runner.graphs
    )  # None: every step eager (--enforce-eager, or capture failed)
    print("decode CUDA graphs:", graphs.buckets if graphs is not None else "none: eager steps")
    step_bytes, params = weight_bytes(engine)
    print(f"a decode step reads {step_bytes / 1e9:.2f} GB of weights; {params / 1e9:.2f} G params")
    warm_up(engine, args)
    rows = {"decode": [], "prefill": []}
    print(f"steps overlapped: {engine.overlap}")
    for b in args.batches:
        if args.overlap_ab:
            engine.overlap = True
            run_bench(engine, b, b, DECODE_IN, 8)  # the overlapped path's warm-up
            ab = overlap_rows(engine, b, copy_gbs, step_bytes, args.repeats)
            rows.setdefault("overlap_ab", []).append(ab)
            for name, d in ab.items():
                print(
                    f"decode  B={b:3d} {name:>7}: {d['stream_tok_s']:7.1f} tok/s a stream, "
                    f"{d['aggregate_tok_s']:8.1f} aggregate; roofline {d['roofline_tok_s']:.0f}"
                    f" -> {d['fraction']:.0%}; runs {_spread(d['runs_stream_tok_s'])}"
                )
            continue
        d = decode_row(engine, b, copy_gbs, step_bytes, args.repeats)
        rows["decode"].append(d)
        print(
            f"decode  B={b:3d}: {d['stream_tok_s']:7.1f} tok/s a stream, "
            f"{d['aggregate_tok_s']:8.1f} aggregate ({d['wall_output_tok_s']:.1f} over the wall "
            f"with prefill); roofline {d['roofline_tok_s']:.0f} -> {d['fraction']:.0%}; "
            f"runs {_spread(d['runs_stream_tok_s'])}"
        )
    if graphs is not None:  # decode steps that missed the graphs ran eagerly (and slowly)
        print(f"decode steps through the graph buffers: {graphs.steps}")
    for p in args.prefill:
        r = prefill_row(engine, p, tflops, params, args.repeats)
        rows["prefill"].append(r)
        print(
            f"prefill P={p:5d}: {r['tok_s']:8.0f} tok/s, {r['tflops']:.0f} TFLOP/s "
            f"-> {r['fraction']:.0%} of the bf16 matmul rate; runs {_spread(r['runs_tok_s'])}"
        )
    if args.json:
        meta = {"copy_gbs": copy_gbs, "tflops": tflops, "model": args.model, **vars(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, **rows}, indent=1))


if __name__ == "__main__":
    main()
