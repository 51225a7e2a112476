"""The Gluon kernel of the sorted MoE blocks (kernels/triton_gluon_moe.py).

Gluon compiles but does not run under Triton's interpreter. On any machine the kernel is compiled
for each architecture the project targets, through the real wrapper (triton_moe with MM_GLUON):
the layout conversions it asserts trivial (the weights decoded in the registers the tensor cores
read, x's fragments rearranged within each thread) and the absence of shared memory are checked
by the compiler there. Where CUDA is, its outputs are compared with the reference for each type
it takes, in bf16 and fp16, 8 and 16 slots a block, rows that do not fill a program.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.support.expert_blocks import random_experts  # noqa: E402
from tests.support.triton_compile_check import compile_in_subprocess  # noqa: E402

TYPES = ("Q4_K", "Q4_0", "Q4_1", "Q6_K")
LAUNCHES = ("dense_gluon", "moe_gluon", "moe_gluon_bt8", "moe_gluon_fp16")
ARCHS = (80, 86, 89, 90, 120)  # A100, RTX 3090, RTX 4090, H100 / H200, RTX 5090

COMPILE = """
import sys
from tests.support.triton_compile_check import compiling_for, moe_gluon_launches
for arch in map(int, sys.argv[1].split(",")):
    for t in sys.argv[2].split(","):
        for name, call in moe_gluon_launches(t):
            with compiling_for(arch) as log:
                call()
            for fn, k in zip(log.compiled, log.kernels):
                print(arch, t, name, fn[0], k.metadata.shared)
"""


def test_compiles_for_each_architecture_without_shared_memory() -> None:
    """A process without the interpreter (the switch is read at triton's first import)."""
    stdout = compile_in_subprocess(COMPILE, ",".join(map(str, ARCHS)), ",".join(TYPES))
    rows = [(int(a), t, name, fn, int(shared)) for a, t, name, fn, shared in (
        line.split() for line in stdout.splitlines()
    )]  # fmt: skip
    want = {(a, t, n) for a in ARCHS for t in TYPES for n in LAUNCHES}
    gluon = [row for row in rows if row[3] == "moe_mm_mma_kernel"]  # (and the slots' sort)
    assert {row[:3] for row in gluon} == want
    assert all(shared == 0 for *_, shared in gluon)


def test_takes_only_the_types_and_shapes_it_reads() -> None:
    from hetero.kernels import triton_moe as tm
    from hetero.kernels.repack import SPECS
    from hetero.quant import get_quant

    def takes(name: str, dtype=torch.bfloat16, k: int = 2048, bt: int = 16) -> bool:
        return tm.gluon_takes(SPECS[get_quant(name).ggml_type], layout, dtype, k, bt)

    layout = "fields"
    assert all(takes(t) for t in TYPES) and takes("Q4_K", torch.float16, 768, 8)
    assert not any(takes(t) for t in ("Q5_K", "Q3_K", "Q8_0", "IQ4_XS", "MXFP4", "Q2_K"))
    assert not takes("Q4_K", torch.float32)  # float32 x: the Triton kernel's exact rounding
    assert not takes("Q4_K", k=2048 + 32)  # a step is 128 codes
    assert not takes("Q4_K", bt=32)  # x's fragments of 32 slots would not fit the registers
    layout = "bytes"  # (the integer GEMV's arrangement of a high plane)
    assert takes("Q4_K") and not takes("Q6_K")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES)
def test_equals_the_reference_on_the_device(ggml_type: str, monkeypatch) -> None:
    from hetero.kernels import triton_moe as tm
    from hetero.kernels.moe import moe_matmul_ref, slot_rows
    from hetero.quant import dequantize, get_quant

    qt = int(get_quant(ggml_type).ggml_type)
    e, n, k, top = 16, 200, 768, 4  # 200 rows: the last program's rows past N clamped
    raw = random_experts(ggml_type, e, n, k, seed=3, device="cuda")
    packed = tm.prepare_moe(raw, qt, (e, n, k))
    w = dequantize(raw.reshape(e * n, -1), qt, (e * n, k)).abs().view(e, n, k)
    monkeypatch.setattr(tm, "MM_GLUON", True)
    g = torch.Generator().manual_seed(0)
    # 24 tokens: 96 slots over 16 experts (8 and 16 slots a block); 60: 240 slots (16), and
    # expert 0 favoured so that it fills several blocks
    for t, min_bt in ((24, 8), (24, 16), (60, 16)):
        monkeypatch.setattr(tm, "GLUON_MIN_BT", min_bt)
        scores = torch.rand(t, e, generator=g)
        scores[:, 0] += 0.5
        ids = scores.topk(top, dim=-1).indices.cuda()
        for dtype in (torch.bfloat16, torch.float16):
            for rows in (t, t * top):  # gate/up read a token's row, down a slot's
                x = torch.randn(rows, k, generator=g).to("cuda", dtype)
                got = tm.moe_matmul_triton(x, packed, qt, (e, n, k), ids).float()
                want = moe_matmul_ref(x.float(), raw, qt, (e, n, k), ids)
                bound = (x.float().abs()[slot_rows(x, ids)][:, None, :] * w[ids.flatten()]).sum(-1)
                err = (got - want).abs()
                # the weights rounded to x's type (A and B first: 2^-9 each in bf16), y too
                tol = 2.0**-6 * bound + 2.0**-7 * want.abs() + 1e-3
                assert (err <= tol).all(), (
                    f"{ggml_type} T={t} bt>={min_bt} {dtype}: max error {err.max().item():.3e}"
                )


def test_an_older_triton_keeps_the_triton_kernel(monkeypatch) -> None:
    """Gluon's API moves between releases: the kernel is written for Triton 3.6, and an older
    Triton (older torch builds bring one) must not reach it."""
    import triton

    from hetero.kernels import triton_moe as tm

    tm._has_gluon.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.4.0")
        assert not tm._has_gluon()
        tm._has_gluon.cache_clear()
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        assert tm._has_gluon()
    finally:
        tm._has_gluon.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_a_dense_weight_as_one_expert_equals_the_reference(ggml_type: str) -> None:
    from hetero.kernels import triton_moe as tm
    from hetero.kernels.repack import repack
    from hetero.quant import dequantize, get_quant

    qt = get_quant(ggml_type).ggml_type
    n, k = 200, 768
    raw = random_experts(ggml_type, 1, n, k, seed=5, device="cuda")[0]
    pw = repack(raw, qt, (n, k))
    w = dequantize(raw, qt, (n, k))
    g = torch.Generator().manual_seed(2)
    for t, bt in ((40, 16), (13, 8)):  # blocks with padding rows
        x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
        got = tm.gluon_dense(x, pw, bt=bt).float()
        want = x.float() @ w.T
        tol = 2.0**-6 * (x.float().abs() @ w.abs().T) + 2.0**-7 * want.abs() + 1e-3
        assert ((got - want).abs() <= tol).all(), (ggml_type, t, bt)
