"""The rows of benchmarks/pipeline.py: which engines a preset compares, and the planner's numbers.

A row is (label, options for LLM, stages) where stages lists the row's stages as
(device, layer_start, layer_end, mps_percentage) for the planner's prediction. A pipeline row
runs from a plan file of its stages, each with its weights mode (GPU stages: --weights, the
same as the one-stage row on that GPU; CPU stages: "auto", the CPU's fp16 repack) and MPS share.
"""

from __future__ import annotations

import json
import tempfile

from hetero.planner.shares import parse_share

Stage = tuple[str, int, int, int | None]  # device, [start, end), MPS percentage


def plan_file(stages: list[Stage], gpu_weights: str) -> str:
    """A hand-written plan of these stages (read by hetero/pipeline/stages.py)."""
    rows = []
    for device, a, b, mps in stages:
        row = {"device": device, "layer_start": a, "layer_end": b}
        if device.startswith("cuda"):
            row["weights"] = gpu_weights
        if mps is not None:
            row["mps_percentage"] = mps
        rows.append(row)
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"stages": rows}, f)
    f.close()
    return f.name


def split_at(devices: list[str], bounds: list[int], n: int, mps=None) -> list[Stage]:
    """Stages over `devices` cut before each layer in `bounds`."""
    edges = [0, *bounds, n]
    mps = mps or [None] * len(devices)
    return [(d, edges[i], edges[i + 1], mps[i]) for i, d in enumerate(devices)]


def have_profile() -> bool:
    """Whether this machine's profile is cached (`hetero profile`): the planner then answers at
    once, where it would otherwise measure every device first (minutes) inside a row."""
    try:
        from hetero.profiler.machine import fingerprint, live_devices, load_cached

        return load_cached(fingerprint(live_devices())) is not None
    except Exception:  # noqa: BLE001 - no planner, no devices: no prediction
        return False


def planned_bounds(
    model: str, names: list[str], fallback: list[int], concurrency: int
) -> tuple[list[int], str]:
    """Where the planner cuts the layers over `names` (every device used) for `concurrency`
    streams, or `fallback` when it cannot plan them (no profile, no planner). The rows compare
    splits at their most streams: at one stream the planner rightly puts all but one layer on
    the fastest device, as a pipeline cannot speed up a single stream."""
    if not have_profile():
        return fallback, "fallback (no profile)"
    try:
        from hetero.planner.model_desc import describe
        from hetero.planner.plan import PlanConfig, plan
        from hetero.planner.resolve import resolve_devices
        from hetero.profiler.machine import ThisMachine

        devices = resolve_devices(names, ThisMachine(progress=False))
        cfg = PlanConfig(use_all_devices=True, context=4096, concurrency=concurrency)
        p = plan(describe(model), devices, cfg)
        return [s.layer_start for s in p.stages[1:]], f"planned for {concurrency} streams"
    except Exception as e:  # a benchmark row must still run: say why, use the fallback
        return fallback, f"fallback ({type(e).__name__}: {str(e)[:80]})"


def rows(name: str, model: str, n: int, args) -> list[tuple[str, dict, list[Stage]]]:
    w, most = args.weights, max(args.streams)
    one = ("1 stage cuda:0", {"device": "cuda:0", "weights": w}, [("cuda:0", 0, n, None)])

    def pipe(label: str, stages: list[Stage]):
        cuts = "/".join(f"{a}-{b - 1}" for _, a, b, _ in stages)
        return (f"[{cuts}] {label}", {"plan": plan_file(stages, w)}, stages)

    if name == "gpus":  # two real GPUs over NCCL; the planned split prices cuda:1 as slower
        slow = args.slow
        cut, how = planned_bounds(model, ["cuda:0", slow], [n * 5 // 8], most)
        # --slow-real: cuda:1's stage really runs on that share of its SMs (MPS), so the slower
        # card is emulated, not only priced
        mps = [None, round(parse_share(slow).percent)] if args.slow_real else None
        tag = f" (cuda:1 at {mps[1]}% under MPS)" if mps else ""
        gpu2 = ["cuda:0", "cuda:1"]
        return [
            one,
            pipe(f"cuda:0,cuda:1 even{tag}", split_at(gpu2, [n // 2], n, mps)),
            pipe(f"cuda:0,cuda:1 split {how} for cuda:0+{slow}{tag}", split_at(gpu2, cut, n, mps)),
        ]
    if name == "mps":  # one GPU as two unequal ones (run `nvidia-cuda-mps-control -d` first)
        a, b = args.mps
        names = [f"cuda:0@{a}%", f"cuda:0@{b}%"]
        cut, how = planned_bounds(model, names, [round(n * a / (a + b))], most)
        gpu2 = ["cuda:0", "cuda:0"]
        return [
            one,
            pipe(f"MPS {a}/{b} even", split_at(gpu2, [n // 2], n, [a, b])),
            pipe(f"MPS {a}/{b} split {how}", split_at(gpu2, cut, n, [a, b])),
        ]
    if name == "gpucpu":  # VRAM short: the last layers (and the head) on the CPU
        k = args.cpu_layers or 4
        return [one, pipe(f"cuda:0 + cpu ({k} layers)", split_at(["cuda:0", "cpu"], [n - k], n))]
    if name == "cpu":
        return [
            ("1 stage cpu", {"device": "cpu"}, [("cpu", 0, n, None)]),
            ("1 stage cpu, 1 thread", {"device": "cpu", "threads": 1}, [("cpu", 0, n, None)]),
            ("2 stages cpu,cpu (a thread each)", {"devices": "cpu,cpu"},
             split_at(["cpu", "cpu"], [n - n // 2], n)),
        ]  # fmt: skip
    k = args.cpu_layers or 8  # h200: one GPU, two stages on it (through host memory), GPU + CPU
    return [
        one,
        pipe("2 stages on cuda:0", split_at(["cuda:0", "cuda:0"], [n // 2], n)),
        pipe(f"cuda:0 + cpu ({k} layers)", split_at(["cuda:0", "cpu"], [n - k], n)),
    ]


def predict(model: str, stages: list[Stage], gpu_weights: str, c: int, args) -> float | None:
    """The planner's aggregate decode tok/s for this row's split at c streams (None: no
    profile of these devices, or no planner)."""
    if not have_profile():
        return None
    try:
        from hetero.cli_plan import plan_config
        from hetero.planner.model_desc import describe
        from hetero.planner.placement import place_split
        from hetero.planner.resolve import resolve_devices
        from hetero.profiler.machine import ThisMachine

        names = [d if m is None else f"{d}@{m}%" for d, _, _, m in stages]
        devices = resolve_devices(names, ThisMachine(progress=False))
        cfg = plan_config(
            concurrency=c,
            prompt_len=args.input_len,
            output_len=args.output_len,
            context=args.input_len + args.output_len + 16,
            max_num_seqs=max(args.streams),
            kv_dtype=args.kv_dtype,
        )
        weights = [gpu_weights if d.startswith("cuda") else "auto" for d, _, _, _ in stages]
        p = place_split(describe(model), devices, cfg, [(a, b) for _, a, b, _ in stages], weights)
        return p.aggregate_tok_s
    except Exception:  # noqa: BLE001 - a prediction is optional; the row is measured anyway
        return None
