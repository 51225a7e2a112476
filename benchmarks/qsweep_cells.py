"""The cells of benchmarks/gpu_qsweep.py: candidates per T, weights, one worker's measurements.

A candidate is a `triton_qvariants.Variant` name (kernel:tile:step:split:warps:stages), `auto`
(qlinear's own dispatch) or `dense` (dequantize to bf16 + cuBLAS, T >= 64). Weights are repacked
as the engine holds them (the "bytes" high plane).
"""

from __future__ import annotations

import functools
import json
import math
import time
import traceback

import numpy as np
import torch

from hetero.kernels import triton_qmatmul as tq
from hetero.kernels import triton_qvariants as tv
from hetero.kernels.repack import PackedWeight, repack
from hetero.quant import get_quant, random_blocks

SHAPES = {  # name -> (N, K): y [T, N] = x [T, K] @ W^T; measured in this order (a budget cut
    "gateup": (14336, 4096),  # drops the last)
    "down": (4096, 14336),
    "qo": (4096, 4096),
    "kv": (1024, 4096),
    "lmhead": (128256, 4096),
}
FUSED_SHAPES = {  # the fused linears the model loads (not in a default run): q|k|v, q|k (where
    "qkv": (6144, 4096),  # a Q4_K_M layer's v is Q6_K), gate|up
    "qk": (5120, 4096),
    "gateup2": (28672, 4096),
}
ALL_SHAPES = {**SHAPES, **FUSED_SHAPES}
LMHEAD_T = (1, 16, 512)  # the output projection runs once a step: a few T say enough
ROTATE_BYTES = 160 << 20  # weights a replay streams: 3x the L2, as layers rotate through it
REPLAYS = 5
RISKY = ("tokens",)  # run last in a cell: the kernel last seen before an illegal access
DEVICE = "cuda"  # a CPU smoke run under TRITON_INTERPRET=1 sets "cpu" (and times nothing real)
X_DTYPE = torch.bfloat16  # the smoke run: float16 (the interpreter's bf16 tl.dot is not exact)


def _mm_tile(t: int) -> int:
    return min(64, max(16, 1 << (t - 1).bit_length()))


def _variants(t: int) -> list[tv.Variant]:
    V = tv.Variant
    out: list[tv.Variant] = []
    if t <= 2:
        for kern in ("gemv", "gemv_pipe"):
            out += [V(kern, bn=bn, ctas=c) for bn in (32, 64) for c in (4, 8)]
            out += [V(kern, bn=64, step=128, ctas=8), V(kern, bn=128, warps=8, ctas=4)]
        out += [V("gemv_pipe", bn=32, ctas=16), V("gemv_pipe", bn=16, ctas=8)]
    if 2 <= t <= 64:
        bt = _mm_tile(t)
        out += [V("mm", bn=64, bt=bt, step=128, ctas=4, stages=3)]
        out += [V("mm", bn=32, bt=bt, step=128, ctas=8, stages=3)]
        out += [V("mm_pipe", bn=64, bt=bt, step=128, ctas=4, stages=s) for s in (1, 3)]
        out += [V("mm_pipe", bn=32, bt=bt, step=128, ctas=8, stages=3)]
        out += [V("mm_pipe", bn=64, bt=bt, step=256, ctas=4, stages=3)]
        out += [V("mm_pipe", bn=32, bt=bt, step=256, ctas=8, stages=3)]
        out += [V("mm_pipe", bn=128, bt=bt, step=128, ctas=2, warps=8, stages=3)]
    if 16 <= t <= 64:  # more warps an SM: the default tile ran 1 warp a scheduler (ncu, T=64)
        out += [V("mm", bn=64, bt=bt, step=s, ctas=c, warps=w, stages=3)
                for s, c, w in ((128, 2, 8), (64, 4, 4), (64, 2, 8), (64, 4, 8))]  # fmt: skip
        out += [V("mm", bn=128, bt=bt, step=64, ctas=2, warps=8, stages=3)]
        out += [V("mm", bn=64, bt=bt, step=128, ctas=2, warps=4, stages=4)]
        out += [V("mm_pipe", bn=64, bt=bt, step=128, ctas=2, warps=8, stages=3)]
        # x operand A, the decoded tile operand B (wgmma reads B from shared memory)
        out += [V("mm_t", bn=bn, bt=bt, step=s, ctas=c, warps=w, stages=st)
                for bn, s, c, w, st in ((64, 128, 4, 4, 3), (64, 256, 4, 4, 3), (64, 64, 4, 4, 4),
                                        (128, 128, 2, 8, 3), (128, 64, 2, 4, 3),
                                        (32, 128, 8, 4, 3), (64, 128, 2, 8, 3))]  # fmt: skip
        # registers capped (248-255 uncapped: 2 programs of 4 warps an SM): 3 or 4 an SM
        out += [V(k, bn=64, bt=bt, step=s, ctas=4, warps=4, stages=3, regs=r)
                for k in ("mm_pipe", "mm_t") for s in (128, 256) for r in (128, 168)]  # fmt: skip
        # Gluon: each code decoded once into the mma.sync fragments for all bt tokens, x's
        # step through shared memory (Q4_K at 64 tokens, registers: bn 64 / 4 warps 122, 128 /
        # 4 190, 128 / 8 100, 256 / 8 166); stages 2: the next step loaded ahead (124, 210,
        # 97, 208); K split for 2 programs an SM where the row tiles are fewer (o, q|k, down),
        # 4 on one
        out += [V("gmm", bn=bn, bt=bt, step=128, warps=w, stages=st, ctas=2)
                for bn, w, st in ((64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 8, 1),
                                  (64, 4, 2), (128, 8, 2), (128, 4, 2))]  # fmt: skip
        out += [V("gmm", bn=64, bt=bt, step=128, warps=4, stages=2, ctas=4)]
        # the same on Hopper's warpgroup MMA (sm_90; registers 123, 102, 99, 187)
        out += [V("gmmw", bn=bn, bt=bt, step=128, warps=w, stages=st, ctas=2)
                for bn, w, st in ((64, 4, 1), (64, 4, 2), (128, 8, 2), (128, 4, 2))]  # fmt: skip
    if t >= 128:
        out += [V("mm", bn=128, bt=128, step=128, ctas=1, warps=8, stages=3)]
        out += [V("mm", bn=128, bt=64, step=128, ctas=1, warps=4, stages=3)]
        out += [V("mm_pipe", bn=128, bt=128, step=128, ctas=1, warps=8, stages=s) for s in (2, 3)]
        out += [V("mm_pipe", bn=128, bt=64, step=128, ctas=1, warps=4, stages=3)]
        out += [V("mm_pipe", bn=64, bt=128, step=128, ctas=1, warps=4, stages=3)]
    if 2 <= t <= 16:
        out += [V("tokens", bn=bn, ctas=c) for bn in (16, 32) for c in (4, 8)]
    return out


ALL_VARIANTS = {v.name: v for t in (1, 2, 4, 8, 16, 32, 64, 512) for v in _variants(t)}


def candidates(t: int, kernels: frozenset[str] | None = None) -> list[str]:
    """Names to time at T = t; `kernels`: only these kernel kinds (auto, dense, gemv, ...)."""
    names = ["auto"] + [v.name for v in _variants(t)]
    if t >= 64:
        names.append("dense")
    if kernels:
        names = [n for n in names if n.split(":")[0] in kernels]
    return sorted(names, key=lambda n: n.split(":")[0] in RISKY)  # risky ones last, else as is


def run_candidate(name: str, x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    if name == "auto":
        return tq.qlinear_triton(x, pw, int(pw.ggml_type), tuple(pw.shape))
    if name == "dense":
        return tq.dense_mm(x, pw)
    return tv.run(x, pw, ALL_VARIANTS[name])


@functools.lru_cache(maxsize=4)
def _pool(ggml_type: str) -> torch.Tensor:
    """65536 random blocks of the type (the project's generator), on the GPU: weights tile it
    (the bytes, not their values, set the timing)."""
    blocks = random_blocks(ggml_type, 1 << 16, np.random.default_rng(0))
    return torch.from_numpy(blocks).to(DEVICE)


def make_weight(ggml_type: str, n: int, k: int) -> PackedWeight:
    qt = get_quant(ggml_type)
    n_blocks = n * k // qt.block_size
    pool = _pool(ggml_type)
    blocks = pool.repeat(math.ceil(n_blocks / pool.shape[0]), 1)[:n_blocks]
    # the high plane as the engine's decode kernels hold it (streamk.prepare_streamk)
    return repack(blocks.reshape(n, -1), ggml_type, (n, k), high_layout="bytes")


def _clone(pw: PackedWeight) -> PackedWeight:
    f = ("codes", "scale", "high", "minv", "d", "dmin")
    planes = {a: _maybe_clone(getattr(pw, a)) for a in f}
    return PackedWeight(pw.ggml_type, pw.shape, **planes, high_layout=pw.high_layout)


def _maybe_clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def cell_jobs(
    ggml_type: str, shapes: list[str], tokens: list[int], kernels: frozenset[str] | None = None
) -> list[tuple[int, dict]]:
    """(id, cell) for every shape x T x candidate of a type: a shape's cells together (its
    weights are built once)."""
    jobs = []
    for shape in shapes:
        for t in tokens:
            if shape == "lmhead" and t not in LMHEAD_T:
                continue
            for name in candidates(t, kernels):
                cell = {"type": ggml_type, "shape": shape, "T": t, "variant": name}
                jobs.append((len(jobs), cell))
    return jobs


def graph_us(fns: list, replays: int = REPLAYS) -> float:
    """Microseconds per call of fns (run in turn), from CUDA-graph replays timed with events."""
    from gpu_qmatmul import graph_time  # the benchmarks' one graph timer (same folder)

    return graph_time(fns, replays) * 1e6


class _Shape:
    """One shape's rotated weights and exact float32 W of a type (for the checks)."""

    def __init__(self, ggml_type: str, shape: str):
        n, k = ALL_SHAPES[shape]
        first = make_weight(ggml_type, n, k)
        copies = max(1, min(64, ROTATE_BYTES // first.nbytes))
        self.pws = [first] + [_clone(first) for _ in range(copies - 1)]
        self.w = tq.qdequant(first, torch.float32)  # the references' values bit for bit
        self.n, self.k = n, k
        self.xs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, K] (bf16), x @ W^T and |x| @ |W|^T (float32)."""
        if t not in self.xs:
            g = torch.Generator(device=DEVICE).manual_seed(t)
            x = torch.randn(t, self.k, device=DEVICE, generator=g).to(X_DTYPE)
            ref = x.float() @ self.w.t()
            self.xs[t] = (x, ref, x.float().abs() @ self.w.abs().t())
        return self.xs[t]


def measure(cell: dict, sh: _Shape) -> dict:
    """Check once against the reference, then time. The tolerance is the tests' for bf16."""
    x, ref, mag = sh.inputs(cell["T"])
    pw = sh.pws[0]
    name = cell["variant"]
    y = run_candidate(name, x, pw).float()
    torch.cuda.synchronize()
    eps = 2.0**-7
    excess = ((y - ref).abs() - (4 * eps * mag + eps * ref.abs() + 1e-6)).max().item()
    ok = bool(torch.isfinite(y).all().item()) and excess <= 0
    us = graph_us([lambda w=w: run_candidate(name, x, w) for w in sh.pws])
    out = {**cell, "ok": ok, "us": us, "bytes": pw.nbytes, "gbs": pw.nbytes / us / 1e3}
    out["tflops"] = 2 * cell["T"] * sh.n * sh.k / us / 1e6
    if not ok:
        out["error"] = f"wrong output: max excess over tolerance {excess:.3g}"
    return out


def _fatal(e: BaseException) -> bool:
    """An error that leaves the CUDA context unusable (the worker must be replaced)."""
    if "illegal" in str(e) or "unspecified launch failure" in str(e):
        return True
    try:
        torch.cuda.synchronize()
        return False
    except Exception:
        return True


def worker(ggml_type: str, jobs: list, log_path: str, deadline: float) -> None:
    """Measure jobs in order, a JSON line before and after each; exit 3 on a fatal error."""
    shape_of: dict[str, _Shape] = {}
    with open(log_path, "a") as log:
        for job_id, cell in jobs:
            if time.time() > deadline:
                return
            print(json.dumps({"job": job_id, "started": True, "cell": cell}), file=log, flush=True)
            try:
                if cell["shape"] not in shape_of:
                    shape_of.clear()
                    torch.cuda.empty_cache()
                    shape_of[cell["shape"]] = _Shape(ggml_type, cell["shape"])
                row = measure(cell, shape_of[cell["shape"]])
            except Exception as e:  # recorded per config; the sweep goes on
                fatal = _fatal(e)
                tb = traceback.format_exc(limit=3)[-600:]
                row = {**cell, "error": f"{type(e).__name__}: {str(e)[:300]}", "trace": tb}
                row["fatal"] = fatal
                print(json.dumps({"job": job_id, **row}), file=log, flush=True)
                if fatal:
                    raise SystemExit(3) from None
                continue
            print(json.dumps({"job": job_id, **row}), file=log, flush=True)


def summarize(rows: list[dict], ceil: dict) -> list[dict]:
    """Best correct candidate per type x shape x T, against `auto`; prints the table."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["type"], r["shape"], r["T"]), []).append(r)
    best = []
    print(f"{'type':5} {'shape':7} {'T':>4} {'best':44} {'us':>8} {'%bw':>5} {'TF/s':>6} "
          f"{'auto us':>8} {'gain':>5} fails")  # fmt: skip
    for key, rs in cells.items():
        good = [r for r in rs if r.get("ok")]
        fails = [r["variant"] for r in rs if not r.get("ok")]
        auto = next((r for r in good if r["variant"] == "auto"), None)
        if not good:
            print(*key, "no correct candidate;", "failed:", ", ".join(fails))
            continue
        b = min(good, key=lambda r: r["us"])
        frac = b["gbs"] / ceil["copy_gbs"]
        gain = auto["us"] / b["us"] if auto else float("nan")
        auto_us = auto["us"] if auto else float("nan")
        print(f"{key[0]:5} {key[1]:7} {key[2]:4d} {b['variant']:44} {b['us']:8.1f} {frac:5.0%} "
              f"{b['tflops']:6.1f} {auto_us:8.1f} {gain:5.2f} {len(fails)}")  # fmt: skip
        best.append({"cell": key, "best": b, "auto_us": auto_us, "bw_frac": frac, "fails": fails})
    _per_token(best)
    for r in rows:
        if r.get("error") and not r["error"].startswith("skipped"):
            print(f"FAILED {r['type']} {r['shape']} T={r['T']} {r['variant']}: {r['error']}")
    return best


# Llama-3-8B's linears a layer: unfused (q, o; k, v; gate, up; down) and fused as loaded
LAYERS = {
    "unfused": {"qo": 2, "kv": 2, "gateup": 2, "down": 1},
    "fused": {"qkv": 1, "qo": 1, "gateup2": 1, "down": 1},
}


def _per_token(best: list[dict]) -> None:
    """Batch-1 decode: the matmuls of a token (32 layers + lm_head), unfused and fused shapes,
    summed from the best and the `auto` times (compare with a measured engine step time)."""
    for ggml_type in sorted({b["cell"][0] for b in best}):
        cell = {(b["cell"][1]): b for b in best if b["cell"][0] == ggml_type and b["cell"][2] == 1}
        for form, layer in LAYERS.items():
            if not all(s in cell for s in (*layer, "lmhead")):
                continue
            for label in ("best", "auto"):

                def us_of(b: dict, label: str = label) -> float:
                    return b["best"]["us"] if label == "best" else b["auto_us"]

                us = 32 * sum(n * us_of(cell[s]) for s, n in layer.items()) + us_of(cell["lmhead"])
                print(f"{ggml_type} T=1 matmuls a token, {form} ({label}): {us / 1e3:.2f} ms "
                      f"-> {1e6 / us:.0f} tok/s if nothing else ran")  # fmt: skip
