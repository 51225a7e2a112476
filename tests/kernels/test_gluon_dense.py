"""The Gluon dense kernel of up to 64 tokens (kernels/triton_gluon_dense.py).

Gluon compiles but does not run under Triton's interpreter. On any machine: x's permutation
against the fragments' column formula, the Q6_K high bits of the "bytes" plane placed by the
kernel's shifts and masks (its integer operations run in numpy on real repacked weights), and
the kernel compiled for each target architecture through the real wrapper (its layout
conversions asserted trivial there). Where CUDA is, its outputs against the reference for each
type, bf16 and fp16, token counts that do not fill a tile and rows that do not fill a program.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.kernels.test_gluon_gemv import _weight  # noqa: E402  (the dense kernels' layout)
from tests.support.triton_compile_check import compile_in_subprocess  # noqa: E402

TYPES = ("Q4_K", "Q4_0", "Q4_1", "Q6_K")
ARCHS = (80, 86, 89, 90, 120)  # A100, RTX 3090, RTX 4090, H100 / H200, RTX 5090
# bn, bt, warps, pipe (the next step loaded ahead, x by cp.async into two buffers), split
# (programs along K; 0: as the wrapper picks, which for these small weights is one)
CONFIGS = (
    (64, 64, 4, False, 0), (128, 64, 4, False, 0), (128, 32, 4, False, 0),
    (128, 64, 8, False, 0), (64, 16, 4, False, 0), (64, 64, 4, True, 0), (128, 64, 8, True, 0),
    (128, 32, 4, True, 0), (64, 64, 4, False, 3), (128, 64, 8, True, 2),
)  # fmt: skip


def test_x_is_permuted_as_the_fragments_read_it() -> None:
    """xp[s, 4 s_hi + w, n, 8 p4 + 2 t + h] = x[n, 128 s + 32 t + 16 h + 8 s_hi + 4 p4 + w]:
    the columns the MoE kernel's A fragments give k-step (s_hi, w) (its `_b_operand`)."""
    from hetero.kernels.triton_gluon_dense import permute_x

    t_count, k = 3, 384
    x = torch.arange(t_count * k, dtype=torch.float32).reshape(t_count, k)
    xp = permute_x(x)
    assert xp.shape == (k // 128, 8, t_count, 16) and xp.is_contiguous()
    s, s_hi, w, n, p4, t, h = np.meshgrid(
        *(np.arange(m) for m in (k // 128, 2, 4, t_count, 2, 4, 2)), indexing="ij"
    )
    want = x.numpy()[n, 128 * s + 32 * t + 16 * h + 8 * s_hi + 4 * p4 + w]
    got = xp.numpy()[s, 4 * s_hi + w, n, 8 * p4 + 2 * t + h]
    np.testing.assert_array_equal(got, want)


def test_q6k_high_bits_go_beside_their_low_codes() -> None:
    """The kernel's integer operations on a Q6_K weight's code and high words (numpy, int32 as
    on the device): each pair's two 16-bit halves hold the 6-bit codes of the elements the
    fragments' formula names."""
    from hetero.kernels.repack import _unpack_fields, _unpack_high_bytes

    n, k = 8, 512
    _, pw = _weight("Q6_K", n, k)
    codes = pw.codes.numpy().astype(np.int64) & 0xFFFFFFFF  # [n, chunks * 4] words
    high = pw.high.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF  # [n, chunks * 2]
    # [n, K] 6-bit codes by the layout's own inverse (dequantize_packed's, which the repack
    # tests hold to the references' values bit for bit)
    full = (_unpack_fields(pw.codes, 4, 4) | _unpack_high_bytes(pw.high, 4, 2) << 4).numpy()
    chunks = k // 32

    def shl(v, m):
        return (v << m) & 0xFFFFFFFF if m >= 0 else v >> -m

    for c in range(chunks):
        for w in range(4):
            ww = codes[:, 4 * c + w]
            hh = high[:, 2 * c + w // 2]
            for s_hi in range(2):
                for p4 in range(2):
                    q = (ww >> (8 * s_hi + 4 * p4)) & 0x000F000F
                    q |= shl(hh, 4 - 2 * p4 - 8 * s_hi - 4 * (w % 2)) & 0x00300030
                    e = 32 * c + 8 * s_hi + 4 * p4 + w  # h = 0; h = 1 is e + 16
                    np.testing.assert_array_equal(q & 0xFFFF, full[:, e])
                    np.testing.assert_array_equal(q >> 16, full[:, e + 16])


def test_takes_only_the_types_and_shapes_it_reads() -> None:
    from hetero.kernels.repack import SPECS
    from hetero.kernels.triton_gluon_dense import dense_takes
    from hetero.quant import get_quant

    def takes(name: str, layout="bytes", dtype=torch.bfloat16, k: int = 4096, bt: int = 64):
        return dense_takes(SPECS[get_quant(name).ggml_type], layout, dtype, k, bt)

    assert all(takes(t) for t in TYPES) and takes("Q4_K", bt=16) and takes("Q4_0", k=128)
    assert not any(takes(t) for t in ("Q5_K", "Q3_K", "Q8_0", "IQ4_XS", "MXFP4", "Q2_K"))
    assert not takes("Q6_K", "fields")  # the MoE kernel's arrangement, not the dense kernels'
    assert not takes("Q4_K", dtype=torch.float32)
    assert not takes("Q4_K", k=4096 + 32) and not takes("Q4_K", bt=128) and not takes("Q4_K", bt=8)


def test_sweep_variants_name_and_check_it() -> None:
    from hetero.kernels import triton_qvariants as tv

    v = tv.Variant("gmm", bn=128, bt=64, step=128)
    assert tv.parse(v.name) == v and v.name.startswith("gmm:bn128bt64:k128")
    _, pw = _weight("Q4_K", 64, 512)
    _, q8 = _weight("Q8_0", 64, 512)
    assert tv.variant_ok(v, pw) and not tv.variant_ok(v, q8)
    assert not tv.variant_ok(tv.Variant("gmm", bn=128, bt=64), pw)  # its step is 128
    assert not tv.variant_ok(tv.Variant("gmm", bn=96, bt=64, step=128), pw)  # 16 x 4 x 1.5
    assert tv.variant_ok(tv.Variant("gmm", bn=64, bt=32, step=128, stages=2), pw)
    assert not tv.variant_ok(tv.Variant("gmm", bn=64, bt=32, step=128, stages=3), pw)
    assert tv.variant_ok(tv.Variant("gmm", bn=64, bt=32, step=128, split=3), pw)
    w = tv.Variant("gmmw", bn=64, bt=64, step=128, warps=4, stages=2)
    assert tv.parse(w.name) == w and tv.variant_ok(w, pw)
    assert not tv.variant_ok(tv.Variant("gmmw", bn=32, bt=64, step=128, warps=2), pw)


# the warpgroup MMA's (sm_90 only), as CONFIGS
WG_CONFIGS = (
    (64, 64, 4, False, 0), (64, 64, 4, True, 0), (128, 64, 8, True, 0), (128, 32, 4, True, 0),
    (64, 64, 4, True, 3),
)  # fmt: skip

COMPILE = """
import sys
import torch
from tests.kernels.test_gluon_dense import CONFIGS, WG_CONFIGS
from tests.kernels.test_gluon_gemv import _weight
from tests.support.triton_compile_check import compiling_for
from hetero.kernels.triton_gluon_dense import dense_mm
for arch in map(int, sys.argv[1].split(",")):
    for t in sys.argv[2].split(","):
        _, pw = _weight(t, 200, 512)
        runs = [(c, False) for c in CONFIGS] + [(c, True) for c in WG_CONFIGS if arch == 90]
        for (bn, bt, warps, pipe, split), wg in runs:
            for dtype in (torch.bfloat16, torch.float16):
                with compiling_for(arch) as log:
                    x = torch.zeros(40, 512, dtype=dtype)
                    dense_mm(x, pw, bn, bt, warps, pipe, wg, split=split)
                for fn, c in zip(log.compiled, log.kernels):
                    cfg = f"{bn}/{bt}/{warps}/{int(pipe)}/{int(wg)}/{split}"
                    print(arch, t, cfg, fn[0], c.metadata.shared)
"""


def test_compiles_for_each_architecture() -> None:
    """A process without the interpreter (the switch is read at triton's first import)."""
    stdout = compile_in_subprocess(COMPILE, ",".join(map(str, ARCHS)), ",".join(TYPES))
    rows = [line.split() for line in stdout.splitlines()]
    got = {(int(a), t, cfg) for a, t, cfg, fn, _ in rows if fn == "dense_mm_mma_kernel"}
    cfgs = {f"{bn}/{bt}/{w}/{int(p)}/0/{s}" for bn, bt, w, p, s in CONFIGS}
    wg = {f"{bn}/{bt}/{w}/{int(p)}/1/{s}" for bn, bt, w, p, s in WG_CONFIGS}
    want = {(a, t, c) for a in ARCHS for t in TYPES for c in cfgs | (wg if a == 90 else set())}
    assert got == want
    for *_, cfg, _, shared in rows:  # x's tile of a step in shared memory (pipe: two), no more
        _, bt, _, pipe, _, _ = map(int, cfg.split("/"))
        assert int(shared) == (1 + pipe) * 8 * bt * 16 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES)
def test_equals_the_reference_on_the_device(ggml_type: str) -> None:
    from hetero.kernels.triton_gluon_dense import dense_mm
    from hetero.quant import dequantize, get_quant

    qt = get_quant(ggml_type).ggml_type
    n, k = 200, 768  # 200 rows: the last program's rows past N clamped
    raw, pw = _weight(ggml_type, n, k, "cuda")
    w = dequantize(raw, qt, (n, k)).to("cuda")
    g = torch.Generator().manual_seed(2)
    hopper = torch.cuda.get_device_capability()[0] == 9
    runs = [(c, False) for c in CONFIGS] + [(c, True) for c in WG_CONFIGS if hopper]
    for (bn, bt, warps, pipe, split), wg in runs:
        for t in (1, 13, 64, 100):  # tiles with padding tokens; several token tiles
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(t, k, generator=g).to("cuda", dtype)
                got = dense_mm(x, pw, bn, bt, warps, pipe, wg, split=split).float()
                want = x.float() @ w.T
                # the weights rounded to x's type (A and B first: 2^-9 each in bf16), y too
                tol = 2.0**-6 * (x.float().abs() @ w.abs().T) + 2.0**-7 * want.abs() + 1e-3
                err = (got - want).abs()
                assert (err <= tol).all(), (
                    f"{ggml_type} {bn}/{bt}/{warps}/{pipe}/{wg}/{split} T={t} {dtype}: "
                    f"max error {err.max():.3e}"
                )
