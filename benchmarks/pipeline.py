"""Pipeline stages against one process: greedy agreement and tok/s at 1 and 16 streams.

    python benchmarks/pipeline.py MODEL --preset cpu                 # 1 vs 2 CPU stages
    python benchmarks/pipeline.py llama3-8b.gguf --preset h200 [--cpu-layers 8] [--rows 2]

Presets (each row is one engine, built, measured, closed; rows in benchmarks/pipeline_presets.py):
  cpu:    one process on the CPU (all cores, then one thread); --devices cpu,cpu.
  gpus:   one stage on cuda:0 against two NCCL stages on cuda:0 and cuda:1, split evenly and as
          the planner splits for cuda:0 beside a slower GPU (--slow, default cuda:1@50%).
  mps:    two stages on cuda:0 under unequal MPS shares (--mps 60,40, standing in for a 5090
          beside a 4090): an even split against the planner's; needs `nvidia-cuda-mps-control -d`.
  gpucpu: all layers on cuda:0 against the last --cpu-layers (4) on the CPU (VRAM short).
  h200:   all layers on cuda:0; two stages on cuda:0 (activations through host memory, as NCCL
          cannot join two ranks on one GPU); the last --cpu-layers (8) on the CPU.
GPU stages and the one-GPU row use --weights (default quant: the Triton kernels) and replay
decode CUDA graphs; CPU stages use the CPU's default (fp16 repack). Each row prints one line:
decode tok/s (streams / median inter-token latency) per stream count, its ratio to row 1, and
the planner's prediction for that split (`hetero profile` first; "-" without a profile).
Every row (and every phase of a pipeline's start) is logged to stderr with a timestamp; a start
longer than --stage-timeout fails naming the stage and its phase. --rows 2,3 runs only those
rows (1-based; the reference greedy tokens then come from the first row run). Each row's engine
is closed and dropped, and its cached GPU and pinned memory released, before the next starts.
Greedy agreement: the first row's outputs are the reference; every other row reports how many
of its tokens match before the first difference (bf16 on a GPU: batch shapes differ between
rows, so a near-tie may flip late in a sequence). Write the 8B file first with
`hetero synth llama3-8b.gguf --shape llama3-8b --quant q4_k_m`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time

from hetero.bench import run_bench
from hetero.llm import LLM
from hetero.sampling import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_presets import predict, rows  # noqa: E402


def agreement(want: list[list[int]], got: list[list[int]]) -> str:
    same = []
    for a, b in zip(want, got):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same.append(k)
    return f"{sum(same)}/{sum(len(a) for a in want)} tokens before the first difference"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def release() -> None:
    """Free what the last row's engine cached in this process (GPU blocks, pinned RAM tier), so
    the next row's stages size their pools from memory that is really free."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        empty_host = empty_host or getattr(torch._C, "_accelerator_emptyHostCache", None)
        if empty_host is not None:
            empty_host()
        free, total = torch.cuda.mem_get_info()
        say(f"cuda:0 {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def measure(model: str, label: str, options: dict, args, reference, stages) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, progress=False, **options, **args.engine)
    start_s = time.perf_counter() - t0
    say(f"{label}: started in {start_s:.1f} s")
    try:
        eng = llm.engine
        greedy = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
        prompts = [[1] + list(range(1000 + 37 * i, 1000 + 37 * i + 20)) for i in range(4)]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        row = {"config": label, "start_s": round(start_s, 1)}
        row["greedy"] = "reference" if reference is None else agreement(reference, outs)
        row["greedy_tokens"] = outs
        run_bench(eng, 1, 1, 16, 4, seed=1)  # warm-up
        say(f"{label}: greedy check done")
        w = options.get("weights", args.weights)
        for c in args.streams:
            say(f"{label}: {c} streams")
            r = run_bench(eng, c, c, args.input_len, args.output_len)
            row[f"tok/s @{c}"] = round(r.output_tok_s, 2)
            row[f"decode tok/s @{c}"] = round(c * r.per_stream_tok_s, 1) if r.itl_s else None
            pred = predict(model, stages, w, c, args)
            row[f"planned tok/s @{c}"] = None if pred is None else round(pred, 1)
        if hasattr(eng.executor, "pipeline"):
            row["kv"] = eng.executor.pipeline.describe()
        return row, outs
    finally:
        llm.engine.close()


def compact(row: dict, base: dict | None, streams: list[int]) -> str:
    """One line: decode tok/s per stream count, against the first row and the planner."""
    cells = [f"{row['config'][:64]:64s}"]
    for c in streams:
        got, pred = row.get(f"decode tok/s @{c}"), row.get(f"planned tok/s @{c}")
        ref = base.get(f"decode tok/s @{c}") if base else None
        cell = f"@{c}: {got if got is not None else '-'}"
        if ref and got:
            cell += f" ({got / ref:.2f}x row 1)"
        if pred:
            cell += f" plan {pred:.0f}"
        cells.append(cell)
    return " | ".join(cells) + f" | greedy {row['greedy']} | start {row['start_s']} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--preset", choices=["cpu", "h200", "mps", "gpus", "gpucpu"], default="cpu")
    ap.add_argument("--mps", type=lambda s: [int(x) for x in s.split(",")], default=[60, 40])
    ap.add_argument(
        "--cpu-layers", type=int, default=None, help="layers on the CPU stage (h200 8, gpucpu 4)"
    )
    ap.add_argument(
        "--weights", default="quant", help="GPU stages' weights mode (and the one-GPU row's)"
    )
    ap.add_argument(
        "--slow", default="cuda:1@50%", help="gpus: what the planner prices the second GPU as"
    )
    ap.add_argument(
        "--slow-real",
        action="store_true",
        help="gpus: run cuda:1's stage on --slow's SM share (needs `nvidia-cuda-mps-control -d`)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the most streams")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="activations (auto: bf16 on a GPU); float32 makes the greedy check exact enough "
        "that random-weight models do not split at bf16 near-ties",
    )
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument(
        "--stage-timeout",
        type=float,
        default=300.0,
        help="seconds a pipeline's "
        "start (or one step) may take before it fails naming the stuck stage",
    )
    ap.add_argument(
        "--rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="run only these rows of the preset, 1-based (e.g. 2 or 1,2)",
    )
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument(
        "--baseline",
        default=None,
        help="an earlier --json: its first row is the reference (greedy tokens, tok/s ratios)",
    )
    args = ap.parse_args()
    args.engine = {
        "kv_dtype": args.kv_dtype,
        "dtype": args.dtype,
        "num_kv_blocks": args.num_kv_blocks,
        "stage_timeout": args.stage_timeout,
        "max_num_seqs": args.max_num_seqs or max(args.streams),
        "speculative": "off",  # plain decode steps, as the planner prices them
    }
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    from hetero.gguf_loader import load_gguf

    n_layers = load_gguf(args.model).config.n_layers
    out, reference, base = [], None, None
    if args.baseline:  # an earlier run's first row (e.g. the one-GPU row of --preset gpus)
        with open(args.baseline) as f:
            base = json.load(f)[0]
        reference = base["greedy_tokens"]
    table = rows(args.preset, args.model, n_layers, args)
    for i in args.rows or range(1, len(table) + 1):
        if not 1 <= i <= len(table):
            raise SystemExit(f"--rows: {i} is not a row of preset {args.preset} (1-{len(table)})")
        label, options, stages = table[i - 1]
        say(f"row {i} ({label}) starting")
        try:
            row, outs = measure(args.model, label, options, args, reference, stages)
        except Exception as e:  # one failed row (a stage that cannot start) must not end the rest
            say(f"row {i} ({label}) FAILED: {type(e).__name__}: {e}")
            print(f"FAILED {label}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            release()
            continue
        reference = reference or outs
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        base = base or (row if len(out) == 1 else None)
        print(compact(row, None if row is base else base, args.streams), flush=True)
        say(f"row {i} ({label}) finished")
        release()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
