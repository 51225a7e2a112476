"""The Stream-K decode kernel (hetero.kernels.streamk) with the codebook types (IQ4_NL, IQ4_XS,
MXFP4): a code indexes a table of values, so the integer dot products, which multiply the code
bytes themselves, cannot run them. The float decode can (tests/kernels/test_triton_streamk.py
runs it for every packed type); here the refusals: config_ok, qgemv_streamk and the kernels
themselves say no to an integer config, `choose` never gives one for any table, and the
registry's "triton_streamk" hands bf16 tokens of these types to qlinear's own decode kernel.
"""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import gemv_tuning, implementations, streamk
from hetero.kernels.repack import SPECS, repack
from hetero.quant import get_quant
from tests.kernels.test_triton_qmatmul import assert_close, make_weight
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    DEVICE,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")
CODEBOOK_TYPES = [t.name for t, s in SPECS.items() if s.codebook]
INT_CONFIGS = [
    streamk.StreamKConfig(bn=16, step=128, ctas_per_sm=3),  # integer dot by chunks
    streamk.StreamKConfig(bn=32, warps=1, rows=True, ctas_per_sm=3),  # a row a thread
]
FLOAT_CONFIG = streamk.StreamKConfig(bn=32, step=256, ctas_per_sm=2, int_dot=False)

test_in_a_fresh_interpreter_process = rerun_test(__file__)


def test_the_codebook_types_are_packed() -> None:
    assert sorted(CODEBOOK_TYPES) == ["IQ4_NL", "IQ4_XS", "MXFP4"]


@pytest.mark.parametrize("ggml_type", CODEBOOK_TYPES)
def test_streamk_refuses_integer_dot_products(ggml_type: str, monkeypatch) -> None:
    raw, _ = make_weight(ggml_type, 37, 512, seed=11)
    pw = repack(raw, ggml_type, (37, 512), high_layout="bytes")
    x = torch.randn(1, 512, device=DEVICE).to(torch.bfloat16)
    assert streamk.config_ok(FLOAT_CONFIG, pw)
    for cfg in INT_CONFIGS:
        assert not streamk.config_ok(cfg, pw)
        with pytest.raises(ValueError, match=f"cannot run {ggml_type}"):
            streamk.qgemv_streamk(x, pw, cfg)
    # past the wrapper's check, the kernels refuse at compile time (a tl.static_assert)
    monkeypatch.setattr(streamk, "config_ok", lambda cfg, pw: True)
    for cfg in INT_CONFIGS:
        with pytest.raises(Exception, match="linear codes"):
            streamk.qgemv_streamk(x, pw, cfg)


TABLE_CONFIGS = [  # what a measured table (or its absence: DEFAULT) may hold for a weight
    gemv_tuning.DEFAULT,
    *INT_CONFIGS,
    streamk.StreamKConfig(step=512),  # a step across K-quant super-blocks
    streamk.StreamKConfig(bn=64, step=512, int_dot=False),
    None,  # qlinear's own kernel won there
]


@pytest.mark.parametrize("ggml_type", [t.name for t in SPECS])
def test_choose_never_picks_a_config_the_type_cannot_run(ggml_type: str, monkeypatch) -> None:
    """For every table entry (and for no entry of the type), bf16 and float32 tokens: the
    chosen config runs the type, or there is none. A codebook type gets the float decode where
    the table's config is one or x is float32, else none; the other types keep a Stream-K
    config wherever the table has one."""
    raw, pw = make_weight(ggml_type, 4, 256, seed=0)
    codebook = SPECS[pw.ggml_type].codebook > 0
    for entry in [*TABLE_CONFIGS, "no entry"]:
        entries = () if entry == "no entry" else ((ggml_type, 4, 256, entry),)
        monkeypatch.setattr(gemv_tuning, "load_table", lambda arch, e=entries: e)
        table_cfg = gemv_tuning.DEFAULT if entry == "no entry" else entry
        table_int = table_cfg is not None and table_cfg.int_dot
        for dtype in (torch.bfloat16, torch.float32):
            got = streamk.choose(pw, torch.zeros(1, 256, dtype=dtype))
            assert got is None or streamk.config_ok(got, pw), (entry, dtype, got)
            if entry is None or (codebook and table_int and dtype == torch.bfloat16):
                assert got is None, (entry, dtype, got)
            else:
                assert got is not None, (entry, dtype)
            if codebook and got is not None:
                assert not got.int_dot


@pytest.mark.parametrize("ggml_type", ["IQ4_XS", "MXFP4"])
def test_registry_sends_codebook_tokens_to_qlinear_kernels(ggml_type: str, monkeypatch) -> None:
    """The registered "triton_streamk" on a codebook weight: the bf16 token by qlinear's own
    decode kernel (no Stream-K launch), the float32 one by the Stream-K float decode; both equal
    the reference within their dtype's rounding."""
    impl = next(i for i in implementations("qlinear") if i.name == "triton_streamk")
    raw, _ = make_weight(ggml_type, 19, 512, seed=21)
    qtype = int(get_quant(ggml_type).ggml_type)
    weight = impl.prepare(raw, qtype, (19, 512))
    launched = []
    real = streamk.qgemv_streamk

    def recording(x, pw, cfg, xq=None):
        launched.append(cfg)
        return real(x, pw, cfg, xq)

    monkeypatch.setattr(streamk, "qgemv_streamk", recording)
    monkeypatch.setattr(gemv_tuning, "load_table", lambda arch: ())  # DEFAULT: rows, integer
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 512, device=DEVICE).to(dtype)
        assert_close(impl.fn(x, weight, qtype, (19, 512)), x, raw, ggml_type)
    assert [cfg.int_dot for cfg in launched] == [False]
