"""The quantized-matmul kernels compiled for a GPU architecture on a machine without one: the
resources (registers, shared memory, local memory: spills) and the instruction mix of the SASS,
to weigh a kernel change before it reaches a GPU.

    python benchmarks/kernel_sass.py [--kernels moe_mm,qmm,qmm_pipe,qgemv] [--type Q4_K]
                                     [--arch 90] [--warps 4] [--bn 64] [--bt 16] [--step 128]
                                     [--dump DIR]

Triton compiles for `--arch` (90: H100/H200, 89: RTX 4090, 120: RTX 5090, 86: RTX 3090) with
the argument types of a real packed weight of `--type` (kernels/repack.py) and bf16
activations; integer arguments are specialised as Triton specialises them at run time
(pointers and strides divisible by 16, save the kernel's do_not_specialize ones), since a
compile without that hint loads with narrower instructions than the GPU runs. Counts are
static (each instruction of the SASS once, a loop's body once however often it runs):
compare two versions of one kernel, not kernels of different shape. `cuobjdump` comes with
Triton's wheel; `--dump DIR` writes each kernel's SASS there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hetero.kernels.repack import chunk_codes, repack, spec_of
from hetero.kernels.triton_qmatmul import _plane_args
from hetero.quant import get_quant, random_blocks

TRITON_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
    torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
}  # fmt: skip
PLANES = ("codes_ptr", "high_ptr", "scale_ptr", "min_ptr", "d_ptr", "dmin_ptr")
OTHER_POINTERS = {
    "x_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
    "sorted_ptr": "*i32", "expert_ptr": "*i32",
}  # fmt: skip


def kernel(name: str):
    if name == "moe_mm":
        from hetero.kernels.triton_moe_kernels import _moe_mm_kernel

        return _moe_mm_kernel
    if name == "qmm_pipe":
        from hetero.kernels.triton_qvariant_kernels import _qmm_pipe_kernel

        return _qmm_pipe_kernel
    from hetero.kernels import triton_qkernels

    return {"qmm": triton_qkernels._qmm_kernel, "qgemv": triton_qkernels._qgemv_kernel}[name]


def compile_sass(fn, ggml_type: str, arch: int, warps: int, consts: dict) -> tuple[str, str]:
    """(SASS, resource usage) of fn for a packed weight of ggml_type."""
    qt = get_quant(ggml_type)
    n, k = 64, 256
    raw = torch.from_numpy(
        random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(0))
    )
    pw = repack(raw.reshape(n, -1), int(qt.ggml_type), (n, k))
    args, meta = _plane_args(pw)
    plane_types = dict(zip(PLANES, (TRITON_TYPES[t.dtype] for t in args[:6]), strict=True))
    constexprs = {**meta, **consts}
    constexprs = {a: v for a, v in constexprs.items() if a in fn.arg_names}
    skip = set(fn.do_not_specialize or ())
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in constexprs:
            sig[a] = "constexpr"
            continue
        sig[a] = plane_types.get(a) or OTHER_POINTERS.get(a) or "i32"
        if sig[a].startswith("*") or (a.endswith("stride") and a not in skip):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(
        fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in constexprs.items()},
        attrs=attrs,
    )  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    tools = Path(os.path.dirname(triton.__file__)) / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        objdump = str(tools / "cuobjdump")
        sass = subprocess.run([objdump, "-sass", cubin], capture_output=True, text=True).stdout
        res = subprocess.run([objdump, "-res-usage", cubin], capture_output=True, text=True).stdout
    usage = " ".join(re.findall(r"(REG:\d+|LOCAL:\d+|STACK:\d+)", res))
    return sass, f"{usage} shared {compiled.metadata.shared} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernels", default="moe_mm,qmm,qmm_pipe,qgemv")
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bn", type=int, default=64, help="weight rows a program")
    ap.add_argument("--bt", type=int, default=16, help="activation rows a program (matmuls)")
    ap.add_argument("--step", type=int, default=128, help="codes of K a step")
    ap.add_argument("--top", type=int, default=24, help="instruction kinds shown")
    ap.add_argument("--dump", type=Path, help="a folder for each kernel's SASS")
    args = ap.parse_args()
    e = chunk_codes(spec_of(args.type).low_bits)
    consts = {"BN": args.bn, "BT": args.bt, "S": max(1, args.step // e), "PRECISION": "tf32"}
    for name in args.kernels.split(","):
        sass, usage = compile_sass(kernel(name), args.type, args.arch, args.warps, consts)
        ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
        kinds = Counter(ops)
        print(f"{name} {args.type} sm_{args.arch} {args.warps} warps {consts}: {usage}, "
              f"{len(ops)} instructions")  # fmt: skip
        print("  " + ", ".join(f"{op} {c}" for op, c in kinds.most_common(args.top)))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}_{args.type}_sm{args.arch}.sass").write_text(sass)


if __name__ == "__main__":
    main()
