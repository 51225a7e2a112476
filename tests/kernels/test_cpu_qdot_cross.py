"""The qdot kernels built for another architecture: aarch64 (NEON with dotprod, and the plain C
build for armv8.0), cross-compiled with zig's C compiler and run under qemu's user-mode emulator
against the same integer reference as tests/test_cpu_qdot.py.

Needs `zig` (the PyPI package ziglang, or a zig on PATH, or HETERO_ZIG naming one) to build and
`qemu-aarch64` (Debian's qemu-user) to run; each part is skipped, saying why, where its tool is
missing. tests/qdot_driver.c reads cases on stdin and answers the outputs on stdout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.kernels import native
from hetero.kernels.cpu_qdot import pack
from hetero.kernels.cpu_qdot_ref import reference_terms
from hetero.quant import get_quant, random_blocks

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TYPES += ("IQ4_NL", "IQ4_XS", "MXFP4")  # the codebook types
BUILDS = {"neon": ("generic+dotprod+fullfp16", 1), "generic": ("generic", 0)}  # -mcpu, qdot_isa


def zig() -> list[str] | None:
    if os.environ.get("HETERO_ZIG"):
        return [os.environ["HETERO_ZIG"]]
    if shutil.which("zig"):
        return ["zig"]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang"]
    return None


@pytest.fixture(scope="module", params=sorted(BUILDS))
def aarch64_driver(request, tmp_path_factory):
    cc = zig()
    if cc is None:
        pytest.skip("no zig to cross-compile with (pip install ziglang)")
    cpu, isa = BUILDS[request.param]
    out = tmp_path_factory.mktemp("aarch64") / f"qdot-{request.param}"
    driver = Path(__file__).with_name("qdot_driver.c")
    flags = ["-target", "aarch64-linux-musl", "-O2", "-std=gnu11", "-pthread", f"-mcpu={cpu}"]
    cmd = [*cc, "cc", *flags, *map(str, native.SOURCES), str(driver), "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, isa


def run_cases(binary, cases) -> list[tuple[int, torch.Tensor]]:
    payload = b""
    for ggml_type, w, x, threads in cases:
        t, k = x.shape
        payload += struct.pack("<ii", ggml_type, threads)
        payload += struct.pack("<qqqq", w.n, k, t, w.packed.nbytes)
        payload += w.packed.numpy().tobytes() + x.numpy().astype("<f4").tobytes()
    r = subprocess.run(
        ["qemu-aarch64", str(binary)], input=payload, capture_output=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out, at = [], 0
    for _, w, x, _ in cases:
        (rc,) = struct.unpack_from("<i", r.stdout, at)
        at += 4
        y = np.frombuffer(r.stdout, dtype="<f4", count=x.shape[0] * w.n, offset=at)
        at += 4 * y.size
        out.append((rc, torch.from_numpy(y.copy()).reshape(x.shape[0], w.n)))
    return out, r.stderr.decode().splitlines()[0]


def test_aarch64_builds_compile_and_equal_the_integer_reference(aarch64_driver):
    binary, isa = aarch64_driver
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("built; no qemu-aarch64 to run it (apt-get install qemu-user)")
    cases, raws = [], []
    for i, name in enumerate(TYPES):
        qt = get_quant(name)
        n, k = 21, 512
        raw = torch.from_numpy(
            random_blocks(name, n * k // qt.block_size, np.random.default_rng(i))
        )
        raw = raw.reshape(n, -1)
        for t, threads in ((1, 1), (9, 2)):  # a register tile and a half, two pool threads
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(10 * i + t))
            cases.append((int(qt.ggml_type), pack(raw, qt, n, k), x, threads))
            raws.append(raw)
    results, first_line = run_cases(binary, cases)
    assert first_line == f"isa {isa}"  # NEON dotprod (1) or the plain C loops (0)
    for (ggml_type, w, x, _), raw, (rc, y) in zip(cases, raws, results):
        assert rc == 0
        ref, size = reference_terms(x, raw, ggml_type, w.n, w.k)
        assert ((y.double() - ref).abs() <= 1e-5 * size + 1e-30).all(), ggml_type
