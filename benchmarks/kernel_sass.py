"""The quantized-matmul kernels compiled for a GPU architecture on a machine without one: the
resources (registers, shared memory, local memory: spills) and the instruction mix of the SASS,
to weigh a kernel change before it reaches a GPU.

    python benchmarks/kernel_sass.py [--kernels moe_mm,mm,mm_pipe,qgemv] [--type Q4_K]
                                     [--arch 90] [--warps 4] [--bn 64] [--bt 16] [--step 128]
                                     [--dump DIR]

Each kernel is reached through its real wrapper on CPU tensors, compiled but not launched
(tests/support/triton_compile_check.compiling_for: Triton's own binder specialises the
arguments as on a GPU), for `--arch` (90: H100/H200, 89: RTX 4090, 120: RTX 5090, 86: RTX
3090): the grouped MoE matmul's sorted blocks (triton_moe's BLOCK_N, MM_STEP, MM_WARPS set from
the flags; `--bt` slots an expert), the tensor-core variants `mm` and `mm_pipe` at `--bt` rows
(triton_qvariants), the one-token GEMV. Counts are static (each instruction of the SASS once, a
loop's body once however often it runs): compare two versions of one kernel, not kernels of
different shape. `cuobjdump` comes with Triton's wheel; `--dump DIR` writes each SASS there.
Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from hetero.kernels import triton_moe as tm
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels import triton_qvariants as tv
from hetero.kernels.repack import repack
from hetero.quant import get_quant, random_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support: a test helper
from tests.support.triton_compile_check import compiling_for  # noqa: E402

K = 512


def launch(name: str, ggml_type: str, args: argparse.Namespace) -> None:
    """One call of the wrapper that runs kernel `name` (compiled, not launched)."""
    qt = get_quant(ggml_type)
    rng = np.random.default_rng(0)
    if name == "moe_mm":
        e, n, top = 8, 64, 2  # bt slots an expert: 4 bt tokens of 2 slots over 8 experts
        raw = torch.from_numpy(random_blocks(ggml_type, e * n * K // qt.block_size, rng))
        packed = tm.prepare_moe(raw.reshape(e, n, -1), int(qt.ggml_type), (e, n, K))
        t = 4 * args.bt
        ids = (torch.arange(t * top) % e).reshape(t, top)
        tm.BLOCK_N, tm.MM_STEP, tm.MM_WARPS = args.bn, args.step, args.warps
        tm.MM_STAGES = args.stages
        tm.MM_GLUON, tm.GLUON_WARPS, tm.GLUON_BN = args.gluon, args.warps, args.bn
        tm._gluon_ok = lambda device: True  # compiled for --arch, launched nowhere
        tm.moe_matmul_triton(torch.zeros(t, K, dtype=torch.bfloat16), packed, qt.ggml_type,
                             (e, n, K), ids)  # fmt: skip
        return
    raw = torch.from_numpy(random_blocks(ggml_type, 64 * K // qt.block_size, rng))
    # the dense Gluon kernel reads the dense kernels' high plane
    layout = "bytes" if name in tv.GLUON else "fields"
    pw = repack(raw.reshape(64, -1), ggml_type, (64, K), high_layout=layout)
    if name == "qgemv":
        tq.qgemv(torch.zeros(1, K, dtype=torch.bfloat16), pw)
        return
    v = tv.Variant(
        name, bn=args.bn, bt=args.bt, step=args.step, warps=args.warps, stages=args.stages or 1
    )
    tv.run(torch.zeros(args.bt, K, dtype=torch.bfloat16), pw, v)


def report(compiled, tools: Path) -> tuple[str, str]:
    """(SASS, resource usage) of one compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        objdump = str(tools / "cuobjdump")
        sass = subprocess.run([objdump, "-sass", cubin], capture_output=True, text=True).stdout
        res = subprocess.run([objdump, "-res-usage", cubin], capture_output=True, text=True).stdout
    usage = " ".join(re.findall(r"(REG:\d+|LOCAL:\d+|STACK:\d+)", res))
    return sass, f"{usage} shared {compiled.metadata.shared} B"


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernels", default="moe_mm,mm,mm_pipe,qgemv")
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bn", type=int, default=64, help="weight rows a program")
    ap.add_argument("--bt", type=int, default=16, help="activation rows a program (matmuls)")
    ap.add_argument("--step", type=int, default=128, help="codes of K a step")
    ap.add_argument("--gluon", action="store_true", help="moe_mm: the Gluon kernel (MM_GLUON)")
    ap.add_argument(
        "--stages", type=int, help="moe_mm: software-pipeline stages; gmm: 2 loads a step ahead"
    )
    ap.add_argument("--top", type=int, default=24, help="instruction kinds shown")
    ap.add_argument("--dump", type=Path, help="a folder for each kernel's SASS")
    args = ap.parse_args()
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in args.kernels.split(","):
        with compiling_for(args.arch) as log:
            launch(name, args.type, args)
        for (kname, _), compiled in zip(log.compiled, log.kernels, strict=True):
            sass, usage = report(compiled, tools)
            ops = re.findall(
                r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M
            )
            print(f"{name}: {kname} {args.type} sm_{args.arch} bn {args.bn} bt {args.bt} step "
                  f"{args.step} {args.warps} warps: {usage}, {len(ops)} instructions")  # fmt: skip
            kinds = Counter(ops).most_common(args.top)
            print("  " + ", ".join(f"{op} {c}" for op, c in kinds))
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{kname}_{args.type}_sm{args.arch}.sass").write_text(sass)


if __name__ == "__main__":
    main()
