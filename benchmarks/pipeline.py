"""Pipeline stages against one process: greedy agreement and tok/s at 1 and 16 streams.

    python benchmarks/pipeline.py MODEL --preset cpu                 # 1 vs 2 CPU stages
    python benchmarks/pipeline.py llama3-8b.gguf --preset h200 [--cpu-layers 8] [--rows 2]

Presets (each row is one engine, built, measured, closed):
  cpu:  one process on the CPU (all cores, then one thread); --devices cpu,cpu (two stages,
        one thread each on a 2-core machine: the pipeline's overlap is the gain over one thread).
  mps:  two stages on cuda:0 under unequal MPS shares (--mps 60,40, standing in for a 5090 beside
        a 4090): an even split against a split by share, and one stage on the whole GPU.
  h200: all layers on cuda:0; two stages on cuda:0 (the pipeline's own overhead: activations
        cross processes through host memory, as NCCL cannot join two ranks on one GPU); the
        last --cpu-layers layers on the CPU (GPU+CPU, as when VRAM runs short).
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
import sys
import tempfile
import time

from hetero.bench import run_bench
from hetero.llm import LLM
from hetero.sampling import SamplingParams


def mps_plan(n_layers: int, shares: list[int], uneven: bool) -> str:
    """A plan file of two stages on cuda:0 under MPS shares; layers even or by share."""
    first = round(n_layers * shares[0] / sum(shares)) if uneven else n_layers // 2
    bounds = [(0, first), (first, n_layers)]
    stages = [
        {"device": "cuda:0", "layer_start": a, "layer_end": b, "mps_percentage": p}
        for (a, b), p in zip(bounds, shares)
    ]
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"stages": stages}, f)
    f.close()
    return f.name


def presets(name: str, n_layers: int, cpu_layers: int, shares) -> list[tuple[str, dict]]:
    if name == "mps":  # the planner issue's emulated unequal pair (run nvidia-cuda-mps-control -d)
        even, uneven = mps_plan(n_layers, shares, False), mps_plan(n_layers, shares, True)
        return [
            ("1 stage cuda:0", {"device": "cuda:0"}),
            (f"MPS {shares} even split", {"plan": even}),
            (f"MPS {shares} split by share", {"plan": uneven}),
        ]
    if name == "cpu":
        return [
            ("1 stage cpu", {"device": "cpu"}),
            ("1 stage cpu, 1 thread", {"device": "cpu", "threads": 1}),
            ("2 stages cpu,cpu (a thread each)", {"devices": "cpu,cpu"}),
        ]
    half, gpu_end = n_layers // 2, n_layers - cpu_layers
    return [
        ("1 stage cuda:0", {"device": "cuda:0"}),
        ("2 stages on cuda:0", {"split": f"cuda:0=0-{half - 1},cuda:0={half}-{n_layers - 1}"}),
        (
            f"cuda:0 + cpu ({cpu_layers} layers)",
            {"split": f"cuda:0=0-{gpu_end - 1},cpu={gpu_end}-{n_layers - 1}"},
        ),
    ]


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


def measure(model: str, label: str, options: dict, args, reference) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, progress=True, **options, **args.engine)
    start_s = time.perf_counter() - t0
    say(f"{label}: started in {start_s:.1f} s")
    try:
        eng = llm.engine
        greedy = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
        prompts = [[1] + list(range(1000 + 37 * i, 1000 + 37 * i + 20)) for i in range(4)]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        row = {"config": label, "start_s": round(start_s, 1)}
        row["greedy"] = "reference" if reference is None else agreement(reference, outs)
        run_bench(eng, 1, 1, 16, 4, seed=1)  # warm-up
        say(f"{label}: greedy check done")
        for c in args.streams:
            say(f"{label}: {c} streams")
            r = run_bench(eng, c, c, args.input_len, args.output_len)
            row[f"tok/s @{c}"] = round(r.output_tok_s, 2)
            row[f"ITL p50 ms @{c}"] = round(1e3 / r.per_stream_tok_s, 1) if r.itl_s else None
        if hasattr(eng, "pipeline"):
            row["kv"] = eng.pipeline.describe()
        return row, outs
    finally:
        llm.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--preset", choices=["cpu", "h200", "mps"], default="cpu")
    ap.add_argument("--mps", type=lambda s: [int(x) for x in s.split(",")], default=[60, 40])
    ap.add_argument("--cpu-layers", type=int, default=8, help="h200: layers on the CPU stage")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--kv-dtype", default="fp8")
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
    args = ap.parse_args()
    args.engine = {
        "kv_dtype": args.kv_dtype,
        "num_kv_blocks": args.num_kv_blocks,
        "stage_timeout": args.stage_timeout,
    }
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    from hetero.gguf_loader import load_gguf

    n_layers = load_gguf(args.model).config.n_layers
    rows, reference = [], None
    table = presets(args.preset, n_layers, args.cpu_layers, args.mps)
    for i in args.rows or range(1, len(table) + 1):
        if not 1 <= i <= len(table):
            raise SystemExit(f"--rows: {i} is not a row of preset {args.preset} (1-{len(table)})")
        label, options = table[i - 1]
        say(f"row {i} ({label}) starting")
        row, outs = measure(args.model, label, options, args, reference)
        reference = reference or outs
        rows.append(row)
        print(json.dumps(row), flush=True)
        say(f"row {i} ({label}) finished")
        release()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
