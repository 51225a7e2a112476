"""The cells of benchmarks/gpu_gemv_suite.py: variants, weights, one (type, shape) measured, the
winners' table and the Llama-3-8B step estimate."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from gpu_qmatmul import ROTATE_BYTES, _random_blocks, graph_time

from hetero.kernels import streamk as sk
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.repack import PackedWeight, chunk_codes, repack
from hetero.kernels.xquant import XLayout, xquant
from hetero.quant import get_quant

DEVICE = "cuda"  # a dry run of the suite's logic sets "cpu" (the interpreter, tiny shapes)
SHAPES = {  # name -> (N, K): W [N, K], y [1, N] = x [1, K] @ W^T (the 8B's linears, fused too)
    "qo": (4096, 4096),
    "kv": (1024, 4096),
    "qk": (5120, 4096),  # q|k fused (Q4_K_M: v is another type in half the layers)
    "qkv": (6144, 4096),
    "gateup": (14336, 4096),
    "gateup2": (28672, 4096),  # gate|up fused, as the model runs it
    "down": (4096, 14336),
    "lmhead": (128256, 4096),
}


@dataclass(frozen=True)
class Variant:
    kind: str  # "auto": qlinear's "triton" on the "fields" plane; "auto_bytes": on "bytes";
    #            "sk": a Stream-K config
    cfg: sk.StreamKConfig | None = None

    @property
    def name(self) -> str:
        return self.kind if self.cfg is None else self.cfg.name

    def compile_key(self) -> tuple:
        """Variants that share compiled kernels (ctas_per_sm is a run-time value)."""
        return (
            self.kind,
            None if self.cfg is None else dataclasses.replace(self.cfg, ctas_per_sm=0),
        )


def all_variants(quick: bool = False) -> list[Variant]:
    cfg = sk.StreamKConfig
    out = [Variant("auto"), Variant("auto_bytes")]
    rows = [(4, 0, False), (2, 0, False), (8, 0, False), (4, 128, False), (4, 0, True),
            (4, 128, True), (2, 0, True)]  # fmt: skip
    ctas = (1, 2, 3, 4)
    if quick:
        rows, ctas = rows[:1] + rows[4:5], (2, 3)
    for warps, maxnreg, pdl in rows:
        for c in ctas:
            out.append(Variant("sk", cfg(bn=32 * warps, warps=warps, rows=True, ctas_per_sm=c,
                                         maxnreg=maxnreg, pdl=pdl)))  # fmt: skip
    for bn in (32,) if quick else (32, 64):
        for c in (4, 8):
            out.append(Variant("sk", cfg(bn=bn, ctas_per_sm=c)))
    for c in (4, 8):
        out.append(Variant("sk", cfg(bn=32, ctas_per_sm=c, int_dot=False)))
    return out


def make_weight(ggml_type: str, n: int, k: int, layout: str, seed: int = 0) -> PackedWeight:
    """A packed random weight on the GPU (random blocks drawn for up to 2^20 blocks, tiled)."""
    qt = get_quant(ggml_type)
    n_blocks = n * k // qt.block_size
    drawn = min(n_blocks, 1 << 20)
    blocks = _random_blocks(ggml_type, drawn, seed).to(DEVICE)
    blocks = blocks.repeat(math.ceil(n_blocks / drawn), 1)[:n_blocks]
    return repack(blocks.reshape(n, -1), ggml_type, (n, k), high_layout=layout)


def rotated(pw: PackedWeight) -> list[PackedWeight]:
    """pw and copies of it: >= ROTATE_BYTES in all (a model's layers do not stay in L2)."""
    copies = max(1, min(128, ROTATE_BYTES // pw.nbytes))

    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    fields = ("codes", "scale", "high", "minv", "d", "dmin")
    return [pw] + [
        dataclasses.replace(pw, **{f: clone(getattr(pw, f)) for f in fields})
        for _ in range(copies - 1)
    ]


def _call(v: Variant, pw: PackedWeight, x: torch.Tensor, xq):
    if v.kind in ("auto", "auto_bytes"):  # what qlinear runs today (qdispatch's rules included)
        return tq.qlinear_triton(x, pw, int(pw.ggml_type), pw.shape)
    return sk.qgemv_streamk(x, pw, v.cfg, xq=xq if v.cfg.int_dot else None)


def compile_jobs(types: list[str], variants: list[Variant]) -> list[tuple[str, Variant]]:
    seen, jobs = set(), []
    for t in types:
        for v in variants:
            key = (t, v.compile_key())
            if key not in seen:
                seen.add(key)
                jobs.append((t, v))
    return jobs


def run_compile_job(job: tuple[str, Variant]) -> str:
    """Compile one variant for one type (a run on a small weight) in a pool process."""
    ggml_type, v = job
    try:
        pw = make_weight(ggml_type, 256, 4096, "fields" if v.kind == "auto" else "bytes")
        if v.cfg is not None and not sk.config_ok(v.cfg, pw):
            return ""
        x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
        _call(v, pw, x, xquant(x, XLayout(pw.spec.low_bits, pw.spec.group)))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported; the timed run records it per cell too
        return f"{ggml_type} {v.name}: {type(e).__name__}: {str(e)[:300]}"


def _poison(nbytes: list[int]) -> None:
    """Blocks of these sizes filled with 0xFF (NaN as bf16 and float32) and freed: the caching
    allocator hands them to the next allocations of those sizes, so a kernel that leaves an
    output element (or reads a partial sum) unwritten shows NaN."""
    blocks = [torch.full((n,), 255, dtype=torch.uint8, device=DEVICE) for n in nbytes]
    del blocks


def _check(v: Variant, pw, x, xq, ref, tol) -> str:
    """'' if v's output on pw is finite, within tol of ref and the same bits twice."""
    n = pw.shape[0]
    sizes = [2 * n, 4 * n, 16 * n]  # y, qlinear's split-K partials
    if v.cfg is not None:  # the Stream-K partials [tiles, max_programs, BN] float32
        e = chunk_codes(pw.spec.low_bits)
        p = v.cfg.ctas_per_sm * tq._sm_count(x.device)
        sch = sk.schedule(n, pw.shape[1] // e, v.cfg.step // e, p, v.cfg.bn)
        sizes.append(4 * sch.tiles * sch.max_programs * v.cfg.bn)
    _poison(sizes)
    y = _call(v, pw, x, xq).float()
    if not torch.isfinite(y).all():
        return f"{int((~torch.isfinite(y)).sum())} of {n} outputs not finite"
    bad = (y - ref).abs() > tol
    if bad.any():
        return (
            f"{int(bad.sum())} of {n} outputs off; max excess {((y - ref).abs() - tol).max():.3g}"
        )
    if not torch.equal(_call(v, pw, x, xq).float(), y):
        return "a second run gave other bits"
    return ""


def _reference(pw: PackedWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T in float32, the bf16 tolerance of tests' assert_close), W exact, in row slabs."""
    n, _ = pw.shape
    ref, scale = torch.empty(1, n, device=DEVICE), torch.empty(1, n, device=DEVICE)
    xf = x.float()
    for s in range(0, n, 16384):
        w = tq.qdequant(pw, torch.float32, slice(s, min(n, s + 16384)))
        ref[:, s : s + w.shape[0]] = xf @ w.t()
        scale[:, s : s + w.shape[0]] = xf.abs() @ w.abs().t()
    eps = 2.0**-7
    return ref, 4 * eps * scale + eps * ref.abs() + 1e-6


def bench_cell(ggml_type: str, shape: str, variants: list[Variant], copy_gbps: float,
               deadline: float) -> list[dict]:  # fmt: skip
    """Every variant on W [N, K] of one type: checked, then timed (rows of gemv_results)."""
    import time

    n, k = SHAPES[shape]
    by_layout = {"bytes": make_weight(ggml_type, n, k, "bytes")}
    by_layout["fields"] = by_layout["bytes"]  # the same planes where the type has no high bits
    if by_layout["bytes"].high is not None:
        by_layout["fields"] = make_weight(ggml_type, n, k, "fields")
    pws = {lay: rotated(pw) for lay, pw in by_layout.items()}
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    ref, tol = _reference(by_layout["bytes"], x)
    layout = XLayout(by_layout["bytes"].spec.low_bits, by_layout["bytes"].spec.group)
    xq = xquant(x, layout)
    base = {"type": ggml_type, "shape": shape, "n": n, "k": k,
            "packed_bytes": by_layout["bytes"].nbytes}  # fmt: skip
    rows = [dict(base, variant="xquant", us=1e6 * graph_time([lambda: xquant(x, layout)] * 20, 10))]
    for v in variants:
        row = dict(base, variant=v.name, kind=v.kind,
                   config=None if v.cfg is None else dataclasses.asdict(v.cfg))  # fmt: skip
        rows.append(row)
        lay = "fields" if v.kind == "auto" else "bytes"
        if v.cfg is not None and not sk.config_ok(v.cfg, by_layout[lay]):
            row["error"] = "config_ok: not for this type"
            continue
        if time.time() > deadline:
            row["error"] = "skipped: budget"
            continue
        try:
            row["error"] = _check(v, by_layout[lay], x, xq, ref, tol)
            if not row["error"]:
                fns = [lambda pw=pw, v=v: _call(v, pw, x, xq) for pw in pws[lay]]
                sec = graph_time(fns, 10)
                row.update(us=sec * 1e6, gbps=by_layout[lay].nbytes / sec / 1e9)
                row["frac"] = row["gbps"] / copy_gbps
        except Exception as e:  # recorded per variant; the cell goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    _print_cell(rows)
    del pws, by_layout
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def _print_cell(rows: list[dict]) -> None:
    ok = sorted(
        (r for r in rows if r.get("us") and r["variant"] != "xquant"), key=lambda r: r["us"]
    )
    head = rows[0]
    auto = next((r for r in rows if r["variant"] == "auto" and r.get("us")), None)
    line = f"{head['type']} {head['shape']} ({head['n']}x{head['k']}): xquant {head['us']:.1f} us"
    if auto:
        line += f"; auto {auto['us']:.1f} us {auto['gbps']:.0f} GB/s"
    for r in ok[:3]:
        line += f"; {r['variant']} {r['us']:.1f} us {r['gbps']:.0f} GB/s ({r['frac']:.0%})"
    print(line, flush=True)


def winners(rows: list[dict], env: dict, ceil: dict) -> dict:
    """The tuning table: per (type, shape) the fastest correct variant (config None: qlinear's
    own decode kernel won)."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r.get("us") and r["variant"] not in ("xquant", "auto_bytes"):
            key = (r["type"], r["shape"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    entries = [
        {"type": r["type"], "shape": r["shape"], "n": r["n"], "k": r["k"], "us": round(r["us"], 2),
         "gbps": round(r["gbps"], 1), "variant": r["variant"], "config": r.get("config")}
        for r in best.values()
    ]  # fmt: skip
    return {**env, "copy_gbps": round(ceil["copy_gbps"], 1), "entries": entries}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def model_step_us(rows: list[dict], table: dict) -> dict[str, dict]:
    """The GEMVs of one Llama-3-8B token from the measured cells: Q4_K_M (q|k Q4_K; v and down
    Q6_K in the more-bits layers; lm_head Q6_K) and Q6_K (q|k|v fused)."""
    best = {(e["type"], e["shape"]): e for e in table["entries"]}
    base = {(r["type"], r["shape"]): r for r in rows if r["variant"] == "auto" and r.get("us")}
    xq = {(r["type"], r["k"]): r["us"] for r in rows if r["variant"] == "xquant"}
    plans = {"Q4_K_M": [], "Q6_K": []}
    for i in range(32):
        hi = "Q6_K" if _more_bits(i, 32) else "Q4_K"
        plans["Q4_K_M"] += [("Q4_K", "qk"), (hi, "kv"), ("Q4_K", "qo"), ("Q4_K", "gateup2"),
                            (hi, "down")]  # fmt: skip
        plans["Q6_K"] += [("Q6_K", "qkv"), ("Q6_K", "qo"), ("Q6_K", "gateup2"), ("Q6_K", "down")]
    for plan in plans.values():
        plan.append(("Q6_K", "lmhead"))
    out = {}
    for name, plan in plans.items():
        if not all(c in best and c in base for c in plan):
            continue
        # one xquant a GEMV: an upper bound (inputs shared by q|k and v, or fused into the norm
        # or the SiLU before them, cost less or nothing)
        quants = sum(xq.get((t, SHAPES[s][1]), 0.0) for t, s in plan)
        out[name] = {
            "best_us": sum(best[c]["us"] for c in plan),
            "base_us": sum(base[c]["us"] for c in plan),
            "xquant_us": quants,
            "bytes": sum(base[c]["packed_bytes"] for c in plan),
        }
    return out


def bench_ops() -> list[dict]:
    """us per call (graph replays, T = 1) of the ops that feed the integer kernels, fused and
    not: the norm before q|k|v (K = 4096) and the SiLU before down (F = 14336)."""
    from hetero.kernels import triton_fused as tf
    from hetero.kernels.xquant import add_rms_norm_xquant, silu_mul_xquant

    x, res = (torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(4096, device=DEVICE) + 0.5
    g, u = (torch.randn(1, 14336, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    rows = []
    for lay in (XLayout(4, 32), XLayout(4, 16), XLayout(8, 32)):
        ops = {
            "add_rms_norm": lambda: tf.add_rms_norm_triton(x, res, w, 1e-6),
            "xquant 4096": lambda lay=lay: xquant(x, lay),
            "add_rms_norm_xquant": lambda lay=lay: add_rms_norm_xquant(x, res, w, 1e-6, lay),
            "silu_mul": lambda: tf.silu_mul_triton(g, u),
            "xquant 14336": lambda lay=lay: xquant(g, lay),
            "silu_mul_xquant": lambda lay=lay: silu_mul_xquant(g, u, lay),
        }
        for name, fn in ops.items():
            try:
                us = 1e6 * graph_time([fn] * 20, 10)
                rows.append({"op": name, "layout": f"lb{lay.low_bits}g{lay.group}", "us": us})
            except Exception as e:  # recorded; the suite goes on
                rows.append({"op": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    for r in rows:
        what = f"{r['us']:.2f} us" if "us" in r else r["error"]
        print(f"op {r['op']:20} {r.get('layout', ''):7} {what}", flush=True)
    return rows


def bench_layouts(types: list[str]) -> list[dict]:
    """qlinear's batched paths on both high-plane arrangements ("nothing else slips" when the
    weights are packed for the integer kernel): the tensor-core kernel at T = 16 and 64 and the
    dequantization before cuBLAS, on the 8B's fused gate|up and down, us per call."""
    rows = []
    for ggml_type in types:
        for shape in ("gateup2", "down"):
            n, k = SHAPES[shape]
            for layout in ("fields", "bytes"):
                pw = make_weight(ggml_type, n, k, layout)
                if pw.high is None and layout == "bytes":
                    continue  # the same planes
                row = {"type": ggml_type, "shape": shape, "layout": layout}
                for t in (16, 64):
                    x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
                    row[f"qmm{t}_us"] = 1e6 * graph_time([lambda x=x, w=pw: tq.qmm(x, w)], 10)
                row["dequant_us"] = 1e6 * graph_time(
                    [lambda w=pw: tq.qdequant(w, torch.bfloat16)], 5
                )
                rows.append(row)
                print("layout", row, flush=True)
    return rows
