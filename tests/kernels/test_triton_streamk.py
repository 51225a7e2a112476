"""The Stream-K decode kernels (hetero.kernels.streamk), their integer activations (xquant) and the
"bytes" high-plane arrangement, against the torch references.

Under Triton's interpreter on a CPU (small shapes; the dp4a / prmt instructions run as their
integer emulation), compiled on a CUDA device. Shapes: N odd (masked rows, a ragged last tile),
K of two or three K-quant super-blocks, legacy types also K = 352 (a step past K); programs few
enough and units many enough that row tiles are split between programs (the fix-up).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.kernels import gemv_tuning, implementations, streamk
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.repack import SPECS, dequantize_packed, repack
from hetero.kernels.xquant import XLayout, dot_elements, xquant, xquant_ref
from hetero.quant import dequantize, get_quant
from tests.kernels.test_triton_qmatmul import assert_close, make_weight
from tests.support.triton_interp import (  # noqa: F401  (kernels_runnable: an autouse fixture)
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels_runnable,
    rerun_test,
)

triton = pytest.importorskip("triton")
TYPES = [t.name for t in SPECS]
HIGH_TYPES = [t.name for t, s in SPECS.items() if s.high_bits]
LAYOUTS = [XLayout(4, 32), XLayout(4, 16), XLayout(8, 32), XLayout(2, 16)]

test_in_a_fresh_interpreter_process = rerun_test(__file__)


def bytes_weight(ggml_type: str, n: int, k: int, seed: int):
    raw, _ = make_weight(ggml_type, n, k, seed)
    return raw, repack(raw, ggml_type, (n, k), high_layout="bytes")


def _shapes(ggml_type: str) -> list[tuple[int, int]]:
    """Under the interpreter one shape a type (a legacy type's with a step past K)."""
    if get_quant(ggml_type).block_size == 256:
        return [(37, 512)] if INTERPRETED else [(37, 768), (1001, 4096)]
    return [(45, 352)] if INTERPRETED else [(37, 512), (45, 352), (1001, 4096)]


# ---------------------------------------------------------------- the "bytes" high plane


@pytest.mark.parametrize("ggml_type", HIGH_TYPES)
def test_bytes_high_plane_holds_the_reference_values(ggml_type: str) -> None:
    raw, pw = bytes_weight(ggml_type, 7, 512, seed=1)
    assert pw.high_layout == "bytes" and pw.high.dtype == SPECS[pw.ggml_type].high_dtype
    exact = dequantize(raw, ggml_type, (7, 512))
    assert torch.equal(dequantize_packed(pw).view(torch.int32), exact.view(torch.int32))
    assert not torch.equal(pw.high, repack(raw, ggml_type, (7, 512)).high)  # another order


@pytest.mark.parametrize("ggml_type", HIGH_TYPES)
def test_float_kernels_read_the_bytes_plane(ggml_type: str) -> None:
    """qlinear's own kernels (dequantize, decode, few-token decode, tensor cores) on a weight
    prepared for the integer kernel."""
    raw, pw = bytes_weight(ggml_type, 37, 512, seed=2)
    exact = dequantize(raw, ggml_type, (37, 512))
    got = tq.qdequant(pw, torch.float32, block_n=32)
    assert torch.equal(got.view(torch.int32), exact.view(torch.int32))
    x = torch.randn(3, 512, device=DEVICE)
    assert_close(tq.qgemv(x, pw, split_k=2, block_n=32), x, raw, ggml_type)
    assert_close(tq.qgemv_tokens(x, pw, split_k=2), x, raw, ggml_type)
    x = torch.randn(17, 512, device=DEVICE).to(torch.float16)
    assert_close(tq.qmm(x, pw, block_n=32, split_k=2), x, raw, ggml_type)


def test_repack_refuses_an_unknown_high_layout() -> None:
    raw, _ = make_weight("Q6_K", 4, 256, seed=0)
    with pytest.raises(ValueError, match="high_layout"):
        repack(raw, "Q6_K", (4, 256), high_layout="planar")


# ---------------------------------------------------------------- activations in fixed point


def _spread_x(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations over 12 binades in every block, some blocks all zero, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * 2.0 ** torch.randint(-6, 6, (t, k), generator=g)
    x[0, :64] = 0
    x[-1, 5] = 3000.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"lb{v.low_bits}g{v.group}")
def test_xquant_kernel_equals_its_reference(layout: XLayout) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _spread_x(3, 320 if layout.chunk == 64 else 352, dtype, seed=layout.low_bits)
        words, floats = xquant(x, layout)
        ref_words, ref_floats = xquant_ref(x, layout)
        assert torch.equal(words, ref_words) and torch.equal(floats, ref_floats)


def _unpack(words: torch.Tensor, layout: XLayout) -> torch.Tensor:
    """xquant words [T, K/E, 2, J, 4] -> m [T, K] in element order (the test's own inverse)."""
    t, n_chunks = words.shape[:2]
    shifts = 8 * torch.arange(4, device=words.device)
    b = (words.reshape(t, n_chunks, 2, -1, 1).to(torch.int64) >> shifts) & 255
    hi = torch.where(b[:, :, 0] >= 128, b[:, :, 0] - 256, b[:, :, 0])  # signed bytes
    m_perm = (hi * 256 + b[:, :, 1]).reshape(t, n_chunks, -1)  # [T, chunks, E] permuted
    m = torch.empty_like(m_perm)
    m[:, :, dot_elements(layout).to(m.device)] = m_perm
    return m.reshape(t, -1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"lb{v.low_bits}g{v.group}")
def test_xquant_values(layout: XLayout) -> None:
    """x = s_b m within 2^-14 of the block's largest |x| (exact for bf16 within 7 binades of
    it), and each unit's float pair is (s_b, s_b sum m)."""
    x = _spread_x(2, 256, torch.bfloat16, seed=7)
    words, floats = xquant_ref(x, layout)
    m = _unpack(words, layout)
    gu = layout.unit
    s_u = floats[:, :, 0]
    s_el = s_u.repeat_interleave(gu, dim=1)
    xf = x.float()
    amax = xf.reshape(2, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    err = (m * s_el - xf).abs()
    assert (err <= amax * 2.0**-14).all()
    near = xf.abs() >= amax * 2.0**-7
    assert (err[near] == 0).all()
    assert torch.equal(floats[:, :, 1], s_u * m.reshape(2, -1, gu).sum(-1).float())


def _dequantized(words, floats, layout: XLayout) -> torch.Tensor:
    """s_b m [T, K] from xquant's layout."""
    m = _unpack(words, layout)
    return m * floats[:, :, 0].repeat_interleave(layout.unit, dim=1)


def _assert_quantized_close(words, floats, ref_words, ref_floats, layout: XLayout) -> None:
    """Two quantizations of nearly equal inputs (a norm's or silu's last bit may differ): the
    values within 2^-14 of each block's largest plus one bf16 step of each element."""
    got, want = _dequantized(words, floats, layout), _dequantized(ref_words, ref_floats, layout)
    amax = want.reshape(want.shape[0], -1, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    excess = (got - want).abs() - (amax * 2.0**-13 + want.abs() * 2.0**-7)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} values past rounding; the worst: element {worst}, "
        f"{got.flatten()[worst].item()!r} for {want.flatten()[worst].item()!r}"
    )


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda v: f"lb{v.low_bits}g{v.group}")
def test_fused_norm_and_silu_quantizers(layout: XLayout) -> None:
    """add_rms_norm_xquant (with and without the residual) and silu_mul_xquant (SiLU and
    gpt-oss's SwiGLU) against their references: the residual sum bit for bit, the quantized
    values within rounding. float16: the interpreter rounds float32 -> bfloat16 by truncation."""
    from hetero.kernels.xquant import (
        add_rms_norm_xquant,
        add_rms_norm_xquant_ref,
        silu_mul_xquant,
        silu_mul_xquant_ref,
    )

    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    x, res = _spread_x(2, 576, dtype, seed=1), _spread_x(2, 576, dtype, seed=2)
    w = torch.rand(576, device=DEVICE) + 0.5
    for r in (res, None):
        *got, total = add_rms_norm_xquant(x, r, w, 1e-6, layout)
        *want, want_total = add_rms_norm_xquant_ref(x, r, w, 1e-6, layout)
        assert torch.equal(total, want_total), (
            f"residual sum, {int((total != want_total).sum())} differ"
        )
        _assert_quantized_close(*got, *want, layout)
    gate, up = x[:, :512], res[:, :512]
    _assert_quantized_close(
        *silu_mul_xquant(gate, up, layout), *silu_mul_xquant_ref(gate, up, layout), layout
    )
    # gpt-oss's clamped SwiGLU (values past its clamps at 7): as the unfused Triton kernel then
    # xquant, bit for bit; against the torch reference within rounding
    gate, up = 4 * gate, 4 * up
    got = silu_mul_xquant(gate, up, layout, "swiglu_oai")
    swiglu = next(i for i in implementations("swiglu_oai") if i.name == "triton").fn
    unfused = xquant(swiglu(gate, up), layout)
    for a, b, what in zip(got, unfused, ("words", "floats"), strict=True):
        assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ"
    _assert_quantized_close(*got, *silu_mul_xquant_ref(gate, up, layout, "swiglu_oai"), layout)


# ---------------------------------------------------------------- the Stream-K kernels

CONFIGS = [  # (config, activation dtype)
    (streamk.StreamKConfig(bn=16, step=128, ctas_per_sm=3), torch.bfloat16),
    (streamk.StreamKConfig(bn=32, step=256, ctas_per_sm=2, int_dot=False), torch.float32),
    (streamk.StreamKConfig(bn=32, warps=1, rows=True, ctas_per_sm=3), torch.bfloat16),
    (streamk.StreamKConfig(bn=64, warps=2, rows=True, ctas_per_sm=1, step=128), torch.float16),
]


@pytest.mark.parametrize("ggml_type", TYPES)
def test_streamk_kernels(ggml_type: str) -> None:
    """Every layout (integer dot by chunks and by rows, the float decode) and type; on the
    device each runs twice for the same bits (the fix-up's counters reset themselves)."""
    for n, k in _shapes(ggml_type):
        raw, pw = bytes_weight(ggml_type, n, k, seed=n + k)
        for cfg, dtype in CONFIGS[:3] if INTERPRETED else CONFIGS:
            if not streamk.config_ok(cfg, pw):
                continue
            x = torch.randn(1, k, device=DEVICE).to(dtype)
            y = streamk.qgemv_streamk(x, pw, cfg)
            assert_close(y, x, raw, ggml_type)
            if CUDA:
                assert torch.equal(streamk.qgemv_streamk(x, pw, cfg), y), cfg.name


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q8_0"])
def test_streamk_on_activations_with_outliers(ggml_type: str) -> None:
    """Blocks spanning 12 binades and a 3000 outlier: within the bf16 bound."""
    raw, pw = bytes_weight(ggml_type, 37, 512, seed=3)
    x = _spread_x(1, 512, torch.bfloat16, seed=3)
    for cfg, _ in CONFIGS[2:3] if INTERPRETED else CONFIGS[::2]:
        assert_close(streamk.qgemv_streamk(x, pw, cfg), x, raw, ggml_type)


def test_streamk_shares_one_xquant_and_refuses_what_it_cannot_run() -> None:
    raw, pw = bytes_weight("Q5_K", 37, 512, seed=4)
    x = torch.randn(1, 512, device=DEVICE).to(torch.bfloat16)
    xq = xquant(x, XLayout(4, 32))
    cfg = CONFIGS[0][0]
    assert torch.equal(streamk.qgemv_streamk(x, pw, cfg, xq=xq), streamk.qgemv_streamk(x, pw, cfg))
    cfg = streamk.StreamKConfig(bn=32, warps=1, rows=True)
    with pytest.raises(ValueError, match="one token"):
        streamk.qgemv_streamk(torch.zeros(2, 512, device=DEVICE), pw, cfg)
    with pytest.raises(ValueError, match="bytes"):
        streamk.qgemv_streamk(x, repack(raw, "Q5_K", (37, 512)), cfg)
    assert not streamk.config_ok(streamk.StreamKConfig(step=512), pw)  # across super-blocks
    assert not streamk.config_ok(streamk.StreamKConfig(bn=64, warps=1, rows=True), pw)
    assert not streamk.config_ok(streamk.StreamKConfig(rows=True, int_dot=False, bn=128), pw)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_registered_streamk_qlinear(ggml_type: str) -> None:
    """The registry's "triton_streamk": its prepare hook, one token by the Stream-K kernel (bf16
    and float32), several by qlinear's default paths, [..., K] inputs."""
    impl = next(i for i in implementations("qlinear") if i.name == "triton_streamk")
    raw, _ = make_weight(ggml_type, 19, 512, seed=21)
    qtype = int(get_quant(ggml_type).ggml_type)
    weight = impl.prepare(raw, qtype, (19, 512))
    assert weight.high_layout == "bytes"
    for t, dtype in ((1, torch.bfloat16), (1, torch.float32), (3, torch.float32)):
        x = torch.randn(t, 512, device=DEVICE).to(dtype)
        assert_close(impl.fn(x, weight, qtype, (19, 512)), x, raw, ggml_type)
    x3 = torch.randn(1, 1, 512, device=DEVICE).to(torch.bfloat16)
    assert impl.fn(x3, raw, qtype, (19, 512)).shape == (1, 1, 19)


# ---------------------------------------------------------------- schedule and tuning tables


@pytest.mark.parametrize(
    "n,k_steps,programs", [(5, 3, 7), (64, 16, 33), (1000, 16, 528), (3, 1, 1)]
)
def test_schedule_covers_every_unit_once(n: int, k_steps: int, programs: int) -> None:
    """Program p runs units [pU/P, (p+1)U/P); `_tile_programs`' formula (first program of a tile,
    their count) matches the runs, and max_programs bounds the count."""
    sch = streamk.schedule(n, k_steps * 8, 8, programs, bn=1)
    u, p = sch.units, sch.programs
    runs = [range(i * u // p, (i + 1) * u // p) for i in range(p)]
    assert sorted(v for r in runs for v in r) == list(range(u))
    for tile in range(sch.tiles):
        t0, ks = tile * sch.ks, sch.ks
        owners = sorted({i for i, r in enumerate(runs) for v in r if t0 <= v < t0 + ks})
        first = ((t0 + 1) * p + u - 1) // u - 1
        last = ((t0 + ks) * p + u - 1) // u - 1
        assert owners == list(range(first, last + 1))
        assert len(owners) <= sch.max_programs


def test_tuning_table_lookup(tmp_path) -> None:
    table = {
        "arch": "sm_90",
        "entries": [
            {"type": "Q4_K", "n": 4096, "k": 4096, "config": {"bn": 64, "ctas_per_sm": 4}},
            {"type": "Q4_K", "n": 28672, "k": 4096, "config": {"bn": 128, "warps": 4,
                                                                  "rows": True, "future": 1}},
        ],
    }  # fmt: skip
    entries = gemv_tuning.parse_table(table)
    assert gemv_tuning.pick(entries, "Q4_K", 4096, 4096).bn == 64
    assert gemv_tuning.pick(entries, "Q4_K", 14336, 4096).rows  # nearest size
    assert gemv_tuning.pick(entries, "Q6_K", 4096, 4096) == gemv_tuning.DEFAULT
    assert gemv_tuning.arch_of("cpu") == "cpu"
    assert gemv_tuning.load_table("sm_0") == ()
    if CUDA:
        major, minor = torch.cuda.get_device_capability()
        assert gemv_tuning.arch_of("cuda") == f"sm_{major}{minor}"


def test_integer_sums_are_exact_in_int32() -> None:
    """The largest |sum q m| of a unit (Q6_K codes < 64, |m| <= 32767, 32 codes) and the hi half
    times 256 stay below 2^31."""
    worst_hi = 32 * 63 * 128
    assert worst_hi * 256 + 32 * 63 * 255 < 2**31
    assert 32 * 255 * 128 * 256 < 2**31  # Q8_0 codes are q + 128 < 256
    assert np.iinfo(np.int32).max >= worst_hi * 256


@pytest.mark.parametrize(
    "path", sorted(Path(gemv_tuning.TABLE_DIR).glob("gemv_tuning_*.json")), ids=lambda p: p.stem
)
def test_checked_in_tables_name_their_arch_and_only_runnable_configs(path: Path) -> None:
    """A table written on one device and checked in: its arch is its file's, and every config
    it gives can run its type (config_ok on a packed weight of that type), so the registry never
    meets an entry it must refuse at run time."""
    table = json.loads(path.read_text())
    assert path.stem == f"gemv_tuning_{table['arch']}"
    entries = gemv_tuning.parse_table(table)
    assert entries
    for type_name, n, k, cfg in entries:
        assert n > 0 and k % 256 == 0
        if cfg is not None:
            _, pw = bytes_weight(type_name, 8, 512, seed=0)
            assert streamk.config_ok(cfg, pw), (type_name, n, k, cfg)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_down_input_quantized_with_its_activation(ggml_type: str) -> None:
    """quantize_input (the feed-forward's SiLU and the down GEMV's quantization in one launch)
    gives the Stream-K kernel the bits that silu_mul's kernel then xquant give; None where the
    token is not one or the activations are float32; a layout it did not make is refused."""
    from hetero.kernels.xquant import QuantizedRows

    raw, pw = bytes_weight(ggml_type, 37, 512, seed=6)
    qt, shape = int(get_quant(ggml_type).ggml_type), (37, 512)
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    gate, up = (3 * torch.randn(2, 512, device=DEVICE)).to(dtype).chunk(2)
    silu = next(i for i in implementations("silu_mul") if i.name == "triton").fn
    xq = streamk.quantize_input(pw, gate, up, "silu")
    assert isinstance(xq, QuantizedRows) and xq.shape == (1, 512)
    got = streamk.qlinear_streamk(xq, pw, qt, shape)
    assert torch.equal(got, streamk.qlinear_streamk(silu(gate, up), pw, qt, shape))
    assert streamk.quantize_input(pw, gate.float(), up.float(), "silu") is None
    two = torch.cat([gate, gate]), torch.cat([up, up])
    assert streamk.quantize_input(pw, *two, "silu") is None
    with pytest.raises(ValueError, match="layout"):
        bad = QuantizedRows(xq.words, xq.floats, XLayout(8, 32), xq.dtype)
        streamk.qlinear_streamk(bad, pw, qt, shape)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_norm_quantized_for_its_linear(ggml_type: str) -> None:
    """quantize_norm (the residual add, the RMSNorm before q|k|v or gate|up and the GEMV's
    quantization in one launch) gives the Stream-K kernel the bits that the add-and-norm kernel
    then xquant give, and the same x + residual; without a residual the norm of x alone; None
    where the token is not one or the activations are float32."""
    from hetero.kernels.xquant import QuantizedRows

    _, pw = bytes_weight(ggml_type, 37, 512, seed=7)
    qt, shape = int(get_quant(ggml_type).ggml_type), (37, 512)
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    x, res = (3 * torch.randn(2, 512, device=DEVICE)).to(dtype).chunk(2)
    w = torch.rand(512, device=DEVICE) + 0.5
    norm = next(i for i in implementations("add_rms_norm") if i.name == "triton").fn
    rms = next(i for i in implementations("rms_norm") if i.name == "triton").fn
    got = streamk.quantize_norm(pw, x, res, w, 1e-5)
    assert got is not None and isinstance(got[0], QuantizedRows) and got[0].shape == (1, 512)
    normed, total = norm(x, res, w, 1e-5)
    assert torch.equal(got[1], total)
    y = streamk.qlinear_streamk(got[0], pw, qt, shape)
    assert torch.equal(y, streamk.qlinear_streamk(normed, pw, qt, shape))
    alone = streamk.quantize_norm(pw, x, None, w, 1e-5)
    assert alone is not None and alone[1] is x
    y = streamk.qlinear_streamk(alone[0], pw, qt, shape)
    assert torch.equal(y, streamk.qlinear_streamk(rms(x, w, 1e-5), pw, qt, shape))
    assert streamk.quantize_norm(pw, x.float(), res.float(), w, 1e-5) is None
    assert streamk.quantize_norm(pw, torch.cat([x, x]), torch.cat([res, res]), w, 1e-5) is None


def test_norm_quantized_for_a_linear_of_two_types() -> None:
    """A linear of parts of two GGUF types (Q4_K_M's q|k beside a Q6_K v): one launch makes
    each part's layout, bit for bit what a launch a layout makes, and x + residual once; parts
    of one layout share its rows. None where a part reads no quantized form (float32 x)."""
    from hetero.kernels.xquant import add_rms_norm_xquant

    parts = [bytes_weight(t, n, 512, seed=n)[1] for t, n in (("Q4_K", 37), ("Q6_K", 11))]
    dtype = torch.float16 if INTERPRETED else torch.bfloat16
    x, res = (3 * torch.randn(2, 512, device=DEVICE)).to(dtype).chunk(2)
    w = torch.rand(512, device=DEVICE) + 0.5
    got, total = streamk.quantize_norm([*parts, parts[0]], x, res, w, 1e-5)
    assert [r.layout for r in got] == [XLayout(4, 32), XLayout(4, 16), XLayout(4, 32)]
    assert got[0] is got[2]
    for rows in got:
        words, floats, alone = add_rms_norm_xquant(x, res, w, 1e-5, rows.layout)
        assert torch.equal(rows.words, words) and torch.equal(rows.floats, floats)
        assert torch.equal(total, alone)
    assert streamk.quantize_norm(parts, x.float(), res.float(), w, 1e-5) is None
