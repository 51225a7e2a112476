"""Quantized matmul microbenchmark for batched decode: us per call and GB/s per path and T.

    python benchmarks/gpu_qmicro.py [--types Q4_K,Q5_K,Q6_K] [--tokens 1,2,4,8,16,32,64]

For each K-quant type and Llama-3-8B linear shape (q/o, k/v, gate/up, down), each T: the decode
kernel (qgemv, T <= 2), the few-token decode kernel (qgemv_tokens, 2 <= T <= 16), the tensor-core
kernel (qmm, T >= 2; mm_bn128: its 128-row, 8-warp tiles, one program an SM, as it ran at every
T before), the Gluon kernel of the MoE blocks with W as one expert (gluon8 / gluon16: 8 or 16
rows a block, at any T: a block of 8 holds one stream's row and 7 of padding; Q4_K, Q4_0,
Q4_1, Q6_K) and `auto` (what qlinear dispatches to at that
T). GB/s counts the packed weight bytes once per call (the activations are tiny next to them),
against the device's copy bandwidth measured in the same run; calls rotate over copies of the
weight (>= 256 MB) from a CUDA graph, as in benchmarks/gpu_qmatmul.py. The lowest time per T
says where GEMV_MAX_T and GEMV_TOKENS_MAX_T (hetero.kernels.triton_qmatmul) belong.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from hetero.kernels import streamk as sk
from hetero.kernels import triton_moe as tm
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.registry import implementations
from hetero.kernels.xquant import XLayout, xquant
from hetero.quant import get_quant

sys.path.insert(0, str(Path(__file__).parent))
from gpu_qmatmul import SHAPES, copy_bandwidth, graph_time, make_packed, rotated  # noqa: E402

MICRO_SHAPES = ["q/o 4096x4096", "k/v 4096x1024", "gate/up 4096x14336", "down 14336x4096"]
EXTRA_SHAPES = {  # --shapes: the 8B's joined weights as the engine holds them (K, N)
    "qk 4096x5120": (4096, 5120),
    "qkv 4096x6144": (4096, 6144),
    "gateup 4096x28672": (4096, 28672),
    "output 4096x128256": SHAPES["output 4096x128256"],
}


LANES: list[str] = []  # --lanes: the Gluon lanes GEMV's configs (R/CPL/WK[/CTAS]) at T = 1


def paths(t: int, pw) -> dict:
    """The kernels worth timing at T = t on weight pw: name -> fn(x, pw)."""
    auto = next(i for i in implementations("qlinear") if i.name == "triton")
    out = {}
    if t <= 2:
        out["gemv"] = tq.qgemv
    if t == 1:  # the Stream-K GEMV as dispatched (its table's config), x quantized beforehand
        cfg = sk.choose(pw, torch.empty(1, 1, dtype=torch.bfloat16, device=pw.device))
        if cfg is not None and sk._int_layout(pw, cfg) is not None:
            out["sk"] = _pre_quantized(pw, cfg)
        for spec in LANES if sk.lanes_take(pw) else []:
            out[f"lanes{spec}"] = _pre_quantized(pw, sk.lanes_config(spec))
    if 2 <= t <= 16:
        out["tokens"] = tq.qgemv_tokens
    if t >= 2:
        out["mm"] = tq.qmm
        out["mm_bn128"] = lambda x, pw: tq.qmm(x, pw, block_n=128)  # the config before T <= 64
    for bt in (8, 16):  # the Gluon kernel of the MoE blocks, W one expert
        takes = tm.gluon_takes(pw.spec, pw.high_layout, torch.bfloat16, pw.shape[1], bt)
        if (bt == 8 or t >= 16) and takes:
            out[f"gluon{bt}"] = lambda x, pw, bt=bt: tm.gluon_dense(x, pw, bt=bt)
    out["auto"] = lambda x, pw: auto.fn(x, pw, int(pw.ggml_type), tuple(pw.shape))
    return out


def _layout() -> str:
    """The high planes' arrangement: the integer GEMV's ("bytes", as the engine packs them on
    a GPU with a tuning table) when lanes configs are timed, else the float decode's."""
    return "bytes" if LANES else "fields"


def _pre_quantized(pw, cfg):
    """fn(x, pw) running cfg on x quantized once (xquant's launch left out of the time)."""
    layout = XLayout(pw.spec.low_bits, pw.spec.group)
    memo: dict = {}

    def run(x, w):
        if memo.get("x") is not x:
            memo.update(x=x, xq=xquant(x, layout))
        return sk.qgemv_streamk(x, w, cfg, xq=memo["xq"])

    return run


def _warm(ggml_type: str, tokens: list[int], lanes: list[str]) -> str:
    """Compile one type's variants (per T: the kernels paths() names) in a worker process."""
    LANES[:] = lanes
    pw, _ = make_packed(ggml_type, 256, 4096, seed=0, high_layout=_layout())
    for t in tokens:
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        for fn in paths(t, pw).values():
            fn(x, pw)
    torch.cuda.synchronize()
    return ggml_type


def measure(ggml_type: str, shape: str, tokens: list[int], copy_gbs: float) -> list[dict]:
    k, n = {**SHAPES, **EXTRA_SHAPES}[shape]
    pws, _ = rotated(ggml_type, n, k, high_layout=_layout())
    rows = []
    for t in tokens:
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"type": ggml_type, "shape": shape, "T": t, "bytes": pws[0].nbytes}
        row.update(n=n, k=k)
        for name, fn in paths(t, pws[0]).items():
            sec = graph_time([lambda w=w, f=fn, x=x: f(x, w) for w in pws], 10)
            row[name] = {"us": sec * 1e6, "gbs": pws[0].nbytes / sec / 1e9}
            row[name]["frac"] = row[name]["gbs"] / copy_gbs
        rows.append(row)
        cells = "  ".join(
            f"{p} {r['us']:7.1f} us {r['gbs']:5.0f} GB/s {r['frac']:4.0%}"
            for p, r in row.items()
            if isinstance(r, dict)
        )
        print(f"{ggml_type} {shape:20s} T={t:3d}  {cells}", flush=True)
    pws.clear()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--lanes", default="", help="Gluon lanes configs R/CPL/WK[/CTAS],...")
    ap.add_argument("--shapes", default=",".join(MICRO_SHAPES), help="comma-separated names")
    args = ap.parse_args()
    LANES.extend(v for v in args.lanes.split(",") if v)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    for t in types:
        get_quant(t)  # names an unknown type before the long part
    tokens = [int(t) for t in args.tokens.split(",")]
    started = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(types), mp_context=ctx) as pool:
        for done in pool.map(_warm, types, [tokens] * len(types), [LANES] * len(types)):
            print("compiled", done, flush=True)
    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s (read+write); compiled in {time.time() - started:.0f} s")
    out = {"copy_gbs": copy_gbs, "rows": []}
    for t in types:
        for shape in shapes:
            out["rows"] += measure(t, shape, tokens, copy_gbs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
