"""Compile the quantized-matmul kernels for a GPU target on any machine, GPU or not.

Triton's interpreter (the CPU tests) runs a kernel's Python, so it never meets the compiler's
front end: a construct the compiler refuses (a starred item in a tuple display, a constexpr
name bound twice in an unrolled loop) passes every interpreter test and fails on the first GPU
launch. Here the launch code itself runs on CPU tensors while `compiling_for(target)` turns each
`kernel[grid](...)` into a compile for `target` (front end, ptxas: the cubin), so the arguments
are exactly those of a real launch:

    python -m tests.support.triton_compile_check [--arch 90] [--types Q4_K,Q6_K]

Uses Triton's binder and argument packing (internal API, as of Triton 3.6). Run it in a process
where TRITON_INTERPRET is unset (the interpreter replaces the kernels when triton is imported).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class CompileLog:
    compiled: list[tuple[str, float]] = field(default_factory=list)  # (kernel, seconds)
    kernels: list = field(default_factory=list)  # Triton's compiled kernels, in that order


@contextmanager
def compiling_for(arch: int = 90, warp_size: int = 32) -> Iterator[CompileLog]:
    """Within the block, `jit_fn[grid](*args, **kw)` compiles for CUDA sm_<arch> and launches
    nothing (the callers' outputs stay unwritten)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", arch, warp_size)
    backend = make_backend(target)
    log = CompileLog()

    def launcher(fn: JITFunction) -> Callable:
        def compile_only(*args, **kwargs):
            kwargs.setdefault("debug", False)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            start = time.perf_counter()
            src = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, sig, constexprs, attrs)
            log.kernels.append(compile(src, target=target, options=options.__dict__))
            log.compiled.append((fn.__name__, time.perf_counter() - start))

        return compile_only

    saved = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: launcher(self)
    try:
        yield log
    finally:
        JITFunction.__getitem__ = saved


def compile_in_subprocess(script: str, *args: str, timeout: float = 900) -> str:
    """Run a compile script (`compiling_for` inside) in a fresh process without the interpreter
    (its switch is read at triton's first import); its stdout, after it exited cleanly."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _weight(ggml_type: str, n: int, k: int):
    from hetero.kernels.repack import repack
    from hetero.quant import get_quant, random_blocks

    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(0))
    return repack(torch.from_numpy(blocks).reshape(n, -1), ggml_type, (n, k))


def launches(ggml_type: str) -> list[tuple[str, Callable[[], object]]]:
    """(name, call) for every kernel qlinear picks and every sweep variant kind, bf16 in."""
    from hetero.kernels import triton_qmatmul as tq
    from hetero.kernels import triton_qvariants as tv

    pw = _weight(ggml_type, 64, 512)

    def x(t: int) -> torch.Tensor:
        return torch.zeros(t, 512, dtype=torch.bfloat16)

    return [
        ("qgemv", lambda: tq.qgemv(x(1), pw)),
        ("qgemv_tokens", lambda: tq.qgemv_tokens(x(5), pw)),
        ("qmm", lambda: tq.qmm(x(8), pw)),
        ("qdequant", lambda: tq.qdequant(pw, torch.bfloat16)),
        ("gemv_pipe", lambda: tv.run(x(1), pw, tv.Variant("gemv_pipe", bn=16, ctas=8))),
        ("tokens_bn16", lambda: tv.run(x(4), pw, tv.Variant("tokens", bn=16))),
        ("mm_pipe", lambda: tv.run(x(4), pw, tv.Variant("mm_pipe", bt=16, step=128, stages=3))),
        ("mm_t", lambda: tv.run(x(4), pw, tv.Variant("mm_t", bt=16, step=128, stages=3))),
        *streamk_launches(ggml_type),
        *qdot_dequant_launches(ggml_type),
        *moe_gluon_launches(ggml_type),
    ]


def moe_gluon_launches(ggml_type: str) -> list[tuple[str, Callable[[], object]]]:
    """The Gluon kernel of the sorted MoE blocks (triton_gluon_moe), where it takes the type:
    8 and 16 slots a block, 64 and 128 rows a program, bf16 and fp16 x."""
    from hetero.kernels import triton_moe as tm
    from hetero.kernels.repack import SPECS, packable
    from hetero.quant import get_quant, random_blocks

    qt = get_quant(ggml_type)
    e, n, k = 8, 128, 512
    if not packable(qt.ggml_type) or not tm.gluon_takes(
        SPECS[qt.ggml_type], "fields", torch.bfloat16, k, 16
    ):
        return []
    blocks = random_blocks(ggml_type, e * n * k // qt.block_size, np.random.default_rng(0))
    packed = tm.prepare_moe(
        torch.from_numpy(blocks).reshape(e, n, -1), int(qt.ggml_type), (e, n, k)
    )

    def run(bn: int, min_bt: int, dtype: torch.dtype, tokens: int):
        saved = tm.MM_GLUON, tm.GLUON_BN, tm.GLUON_MIN_BT, tm._gluon_ok
        tm.MM_GLUON, tm.GLUON_BN, tm.GLUON_MIN_BT = True, bn, min_bt
        tm._gluon_ok = lambda device: True  # compile what a GPU would run
        try:
            ids = (torch.arange(tokens * 2) % e).reshape(tokens, 2)
            x = torch.zeros(tokens, k, dtype=dtype)
            return tm.moe_matmul_triton(x, packed, int(qt.ggml_type), (e, n, k), ids)
        finally:
            tm.MM_GLUON, tm.GLUON_BN, tm.GLUON_MIN_BT, tm._gluon_ok = saved

    def dense() -> object:
        saved = tm._gluon_ok
        tm._gluon_ok = lambda device: True
        try:
            pw = _weight(ggml_type, n, k)
            return tm.gluon_dense(torch.zeros(24, k, dtype=torch.bfloat16), pw)
        finally:
            tm._gluon_ok = saved

    return [
        ("dense_gluon", dense),
        ("moe_gluon", lambda: run(128, 16, torch.bfloat16, 40)),
        ("moe_gluon_bt8", lambda: run(64, 8, torch.bfloat16, 12)),
        ("moe_gluon_fp16", lambda: run(128, 16, torch.float16, 40)),
    ]


def qdot_dequant_launches(ggml_type: str) -> list[tuple[str, Callable[[], object]]]:
    """The CPU packing's GPU decode (a streamed prompt matmul's rows), where it reads the type."""
    from hetero.kernels import cpu_qdot
    from hetero.kernels import triton_qdot_dequant as tqd
    from hetero.quant import get_quant, random_blocks

    qt = get_quant(ggml_type)
    if not tqd.supports(qt.ggml_type):
        return []
    n, k = 40, 512
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(0))
    w = cpu_qdot.pack(torch.from_numpy(blocks).reshape(n, -1), qt, n, k)
    return [
        ("qdot_dequant", lambda: tqd.dequant_rows(w.packed, qt.ggml_type, n, k, 16, n,
                                                  torch.bfloat16)),
    ]  # fmt: skip


def streamk_launches(ggml_type: str) -> list[tuple[str, Callable[[], object]]]:
    """The Stream-K decode kernels (streamk) and their activation quantizer, asm included."""
    from hetero.kernels import streamk as sk
    from hetero.kernels.xquant import XLayout, xquant

    pw = _weight_bytes(ggml_type, 64, 512)
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    lay = XLayout(pw.spec.low_bits, pw.spec.group)
    xq = (torch.zeros(1, 256, dtype=torch.int32), torch.zeros(1, 64, dtype=torch.float32))

    def run(cfg):
        saved = sk._asm_ok
        sk._asm_ok = lambda device: True  # compile the PTX a GPU would run
        try:
            return sk.qgemv_streamk(x, pw, cfg, xq=xq if cfg.int_dot else None)
        finally:
            sk._asm_ok = saved

    from hetero.kernels.xquant import add_rms_norm_xquant, silu_mul_xquant

    w = torch.ones(512)
    configs = [
        ("sk_int", sk.StreamKConfig(bn=32)),
        ("sk_f32", sk.StreamKConfig(bn=32, int_dot=False)),
        ("sk_rows", sk.StreamKConfig(bn=128, warps=4, rows=True)),
    ]
    return [
        ("xquant", lambda: xquant(x, lay)),
        ("xquant_norm", lambda: add_rms_norm_xquant(x, x, w, 1e-6, lay)),
        ("xquant_norm2", lambda: add_rms_norm_xquant(x, x, w, 1e-6, lay, XLayout(4, 16))),
        ("xquant_silu", lambda: silu_mul_xquant(x, x, lay)),
        # the codebook types run the float decode only (streamk.config_ok refuses the others)
        *((name, lambda cfg=cfg: run(cfg)) for name, cfg in configs if sk.config_ok(cfg, pw)),
    ]


def _weight_bytes(ggml_type: str, n: int, k: int):
    """`_weight` with the high plane in the "bytes" arrangement."""
    from hetero.kernels.repack import repack
    from hetero.quant import get_quant, random_blocks

    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(0))
    return repack(torch.from_numpy(blocks).reshape(n, -1), ggml_type, (n, k), "bytes")


def check(types: list[str], arch: int = 90, only: set[str] | None = None) -> list[str]:
    """Compile every launch of `types`; returns the failures ('type name: error')."""
    failures = []
    for ggml_type in types:
        for name, call in launches(ggml_type):
            if only and name not in only:
                continue
            with compiling_for(arch) as log:
                try:
                    call()
                except Exception as e:  # noqa: BLE001  (report every kernel, then fail)
                    failures.append(f"{ggml_type} {name}: {type(e).__name__}: {e}")
                    print(f"FAIL {ggml_type:5} {name}: {str(e)[-600:]}", flush=True)
                    continue
            secs = sum(s for _, s in log.compiled)
            print(f"ok   {ggml_type:5} {name:13} {secs:5.1f} s", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    from hetero.kernels.repack import SPECS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    ap.add_argument("--types", default=",".join(t.name for t in SPECS))
    ap.add_argument("--kernels", default="", help="comma-separated launch names (default all)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: unset it to compile", file=sys.stderr)
        return 2
    only = set(args.kernels.split(",")) if args.kernels else None
    failures = check(args.types.split(","), args.arch, only)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
