"""The Gluon lanes GEMV (kernels/triton_gluon_gemv.py) of one token over 4-bit codes.

Gluon compiles but does not run under Triton's interpreter: on any machine the kernel is compiled
for each architecture the project targets through the real wrapper (streamk.qgemv_streamk with a
lanes config); where CUDA is, its outputs are compared with the dequantized reference and with
the Stream-K kernel, whose integer sums it shares.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.support.triton_compile_check import compile_in_subprocess  # noqa: E402

TYPES = ("Q4_K", "Q4_0", "Q4_1", "Q6_K")
ARCHS = (80, 86, 89, 90, 120)
# rows, chunks a lane, warps, persistent programs an SM (0: a program a row block)
CONFIGS = ((4, 1, 4, 0), (2, 1, 8, 0), (8, 1, 2, 0), (4, 2, 4, 0), (4, 1, 4, 1), (2, 1, 2, 2))

COMPILE = """
import sys
import torch
from tests.kernels.test_gluon_gemv import _weight
from tests.support.triton_compile_check import compiling_for
from hetero.kernels import streamk as sk
from hetero.kernels.xquant import XLayout, xquant_ref
sk.lanes_run = lambda device: True  # CPU tensors: compiled, never launched
for arch in map(int, sys.argv[1].split(",")):
    for t in sys.argv[2].split(","):
        for n, k in ((300, 4096), (64, 14336)):
            pw = _weight(t, n, k)[1]
            x = torch.randn(1, k, dtype=torch.bfloat16)
            xq = xquant_ref(x, XLayout(4, pw.spec.group))
            for pdl, ctas in ((False, 0), (True, 0), (True, 2)):
                cfg = sk.StreamKConfig(bn=4, lanes=1, warps=4, pdl=pdl, ctas_per_sm=ctas)
                with compiling_for(arch) as log:
                    sk.qgemv_streamk(x, pw, cfg, xq=xq)
                for fn, c in zip(log.compiled, log.kernels):
                    print(arch, t, k, f"{pdl}/{ctas}", fn[0], c.metadata.shared)
"""


def test_compiles_for_each_architecture() -> None:
    """A process without the interpreter (the switch is read at triton's first import)."""
    stdout = compile_in_subprocess(COMPILE, ",".join(map(str, ARCHS)), ",".join(TYPES))
    rows = [line.split() for line in stdout.splitlines()]
    got = {(int(a), t, int(k), pdl) for a, t, k, pdl, fn, _ in rows if fn == "qgemv_lanes_kernel"}
    assert got == {(a, t, k, p) for a in ARCHS for t in TYPES for k in (4096, 14336)
                   for p in ("False/0", "True/0", "True/2")}  # fmt: skip
    assert all(int(shared) <= 1024 for *_, shared in rows)  # the row sums' exchange only


def _weight(ggml_type: str, n: int, k: int, device: str = "cpu", layout: str = "bytes"):
    """(GGUF blocks, packed weight): the high plane in the integer GEMV's arrangement, as
    `streamk.prepare_streamk` packs it at load."""
    from hetero.kernels.repack import repack
    from hetero.quant import get_quant, random_blocks

    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, n * k // qt.block_size, np.random.default_rng(n + k))
    raw = torch.from_numpy(blocks).reshape(n, -1)
    return raw, repack(raw.to(device), ggml_type, (n, k), high_layout=layout)


def test_takes_only_the_types_and_configs_it_reads() -> None:
    from hetero.kernels import streamk as sk

    ok = sk.StreamKConfig(bn=4, lanes=1, warps=4, ctas_per_sm=0)
    for t in TYPES:
        assert sk.config_ok(ok, _weight(t, 8, 256)[1])
    for t in ("Q5_K", "Q8_0", "IQ4_NL", "Q5_0", "Q3_K"):  # 1-bit high planes, 8-bit, codebooks
        assert not sk.config_ok(ok, _weight(t, 8, 256)[1])
    assert not sk.config_ok(ok, _weight("Q6_K", 8, 256, layout="fields")[1])
    pw = _weight("Q4_K", 8, 256)[1]
    assert not sk.config_ok(sk.StreamKConfig(bn=3, lanes=1, warps=4), pw)
    assert not sk.config_ok(sk.StreamKConfig(bn=4, lanes=1, warps=4, int_dot=False), pw)
    cfg = sk.StreamKConfig(bn=4, lanes=2, warps=8, pdl=True, ctas_per_sm=0)
    assert cfg.name == "lanes:bn4:l2:w8:pdl"
    assert sk.StreamKConfig(bn=4, lanes=1, warps=2, ctas_per_sm=8).name == "lanes:bn4:l1:w2:c8"


def test_a_table_entry_falls_back_where_gluon_does_not_run(monkeypatch) -> None:
    """A tuning table's lanes entry carries the Triton config that runs where Gluon cannot
    (here the CPU; HETERO_GEMV_LANES=0 the same), and float32 activations never take it."""
    from hetero.kernels import gemv_tuning
    from hetero.kernels import streamk as sk

    table = {
        "entries": [
            {
                "type": "Q4_K",
                "n": 8,
                "k": 256,
                "config": {"bn": 4, "warps": 2, "lanes": 1, "pdl": True},
                "fallback": {"bn": 64, "warps": 4},
            }
        ]
    }
    entries = gemv_tuning.parse_table(table)
    monkeypatch.setattr(gemv_tuning, "load_table", lambda arch: entries)
    pw = _weight("Q4_K", 8, 256)[1]
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert entries[0][3].lanes == 1 and entries[0][3].fallback.bn == 64
    assert sk.choose(pw, x) == sk.StreamKConfig(bn=64, warps=4)  # the CPU: no Gluon
    monkeypatch.setattr(sk, "lanes_run", lambda device: True)
    assert sk.choose(pw, x).lanes == 1
    assert sk.choose(pw, x.float()).lanes == 0  # float32 x: the float decode's rounding
    monkeypatch.setattr(sk, "LANES_DEFAULT", False)  # HETERO_GEMV_LANES=0
    assert sk.choose(pw, x).bn == 64


def test_refused_where_gluon_does_not_run() -> None:
    """On the CPU (or under the interpreter) the lanes config is an error, not a wrong result."""
    from hetero.kernels import streamk as sk

    pw = _weight("Q4_K", 8, 256)[1]
    with pytest.raises(ValueError, match="Gluon"):
        sk.qgemv_streamk(torch.randn(1, 256), pw, sk.StreamKConfig(bn=4, lanes=1, warps=4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES)
def test_equals_the_reference_and_the_stream_k_kernel(ggml_type: str) -> None:
    from hetero.kernels import streamk as sk
    from hetero.quant import dequantize, get_quant

    qt = int(get_quant(ggml_type).ggml_type)
    g = torch.Generator().manual_seed(1)
    # 300 rows: the last program's rows past N; K 14336 (448 chunks) fills no tile of 8 warps
    # x 32 lanes x 2 chunks exactly (masked tail), 4096 does; 1280 is one partial tile
    for n, k in ((300, 4096), (200, 14336), (96, 1280)):
        raw, pw = _weight(ggml_type, n, k, "cuda")
        w = dequantize(raw, qt, (n, k)).float().cuda()
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(1, k, generator=g).to("cuda", dtype)
            want = x.float() @ w.T
            base = sk.qgemv_streamk(x, pw, sk.StreamKConfig()).float()
            bound = x.float().abs() @ w.abs().T
            for r, cpl, wk, ctas in CONFIGS:
                for pdl in (False, True):
                    cfg = sk.StreamKConfig(bn=r, lanes=cpl, warps=wk, pdl=pdl, ctas_per_sm=ctas)
                    got = sk.qgemv_streamk(x, pw, cfg).float()
                    # x in 16-bit fixed point (2^-15 of each block's largest), y rounded
                    tol = 2.0**-12 * bound + 2.0**-7 * want.abs() + 1e-3
                    err = (got - want).abs()
                    assert (err <= tol).all(), f"{cfg.name} {n}x{k} {dtype}: {err.max():.3e}"
                    # the same integer sums as the Stream-K kernel, summed in another order
                    atol = 1e-2 + 2.0**-10 * bound.max()
                    assert torch.allclose(got, base, rtol=2.0**-7, atol=atol)


def test_a_sweep_folds_into_the_tuning_table() -> None:
    """benchmarks/gemv_lanes_table.py: a lanes config that beat the table's takes the entry
    (the Triton config kept as its fallback), one that lost leaves it, a shape without an entry
    gets one; the table then parses to those configs."""
    import importlib.util
    from pathlib import Path

    from hetero.kernels import gemv_tuning

    path = Path(__file__).parents[2] / "benchmarks" / "gemv_lanes_table.py"
    spec = importlib.util.spec_from_file_location("gemv_lanes_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows_cfg = {"bn": 128, "warps": 4, "rows": True, "ctas_per_sm": 4}
    table = {"entries": [
        {"type": "Q4_K", "shape": "qo", "n": 4096, "k": 4096, "us": 8.7, "config": rows_cfg},
        {"type": "Q6_K", "shape": "kv", "n": 1024, "k": 4096, "us": 5.5, "config": rows_cfg},
        {"type": "Q4_K", "shape": "down", "n": 4096, "k": 14336, "us": 18.0, "config": rows_cfg},
    ]}  # fmt: skip

    def cell(us: float) -> dict:
        return {"us": us, "gbs": 1.0, "frac": 0.1}

    sweep = {"copy_gbs": 4200.0, "rows": [
        {"type": "Q4_K", "n": 4096, "k": 4096, "T": 1, "sk": cell(8.7),
         "lanes4/1/2": cell(4.4), "lanes8/1/4": cell(5.1)},
        {"type": "Q6_K", "n": 1024, "k": 4096, "T": 1, "sk": cell(2.0), "lanes8/1/4": cell(2.5)},
        {"type": "Q6_K", "n": 4096, "k": 14336, "T": 1, "lanes4/1/2": cell(16.0)},
        {"type": "Q4_K", "n": 4096, "k": 4096, "T": 16, "mm": cell(13.0)},
    ]}  # fmt: skip
    notes = mod.fold(table, sweep, "today")
    assert len(notes) == 3
    qo, kv, _, down = table["entries"]  # a new entry named as the table names its shape
    assert qo["config"]["lanes"] == 1 and qo["config"]["bn"] == 4 and qo["us"] == 4.4
    assert qo["fallback"] == rows_cfg and qo["fallback_us"] == 8.7
    assert kv["config"] == rows_cfg and "fallback" not in kv
    assert (down["type"], down["shape"], down["config"]["warps"]) == ("Q6_K", "down", 2)
    assert "fallback" not in down  # no Triton entry there before: DEFAULT where Gluon is not
    parsed = gemv_tuning.parse_table(table)
    assert parsed[0][3].lanes == 1 and parsed[0][3].fallback.rows
