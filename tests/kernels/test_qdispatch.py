"""qlinear's dispatch table (hetero.kernels.qdispatch): the cells it overrides, and every rule's
kernel against the torch reference (under Triton's interpreter on a CPU, small shapes)."""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import qdispatch as qd
from hetero.kernels import triton_qmatmul as tq
from hetero.kernels.triton_qvariants import Variant
from tests.kernels.test_triton_qmatmul import assert_close, make_weight
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401  (autouse fixture)

test_in_a_fresh_interpreter_process = rerun_test(__file__)

KV, QO, GATE, LMHEAD = (1024, 4096), (4096, 4096), (14336, 4096), (128256, 4096)


def test_shape_classes() -> None:
    assert [qd.shape_class(*s) for s in (KV, (2048, 4096), QO, (6144, 4096), GATE, LMHEAD)] == [
        *("small", "small", "mid", "mid", "large", "large")
    ]


def test_table_cells() -> None:
    """The sweep's winners where they won, the default paths elsewhere."""
    assert qd.choose("Q8_0", *LMHEAD, 1) == Variant("gemv_pipe", bn=16, ctas=8)
    assert qd.choose("Q4_K", *GATE, 2) == Variant("gemv", bn=64, ctas=8)
    assert qd.choose("Q4_K", *GATE, 1) is None  # within noise of the default
    assert qd.choose("Q6_K", *QO, 2) == "mm"
    assert qd.choose("Q6_K", *KV, 2) is None
    assert qd.choose("Q4_K", *KV, 4) == Variant("tokens", bn=32, ctas=4)
    assert qd.choose("Q8_0", *KV, 4) == Variant("tokens", bn=16, ctas=4)
    assert qd.choose("Q5_K", *KV, 8) is None
    assert qd.choose("Q6_K", *KV, 64) == "dense"
    assert qd.choose("Q4_K", *QO, 64) is None
    assert qd.choose("Q4_K", *KV, 512) is None  # the default path is dense already


def test_rules_of_one_architecture() -> None:
    """The warpgroup Gluon kernel's cells (measured on sm_90) on sm_90 only; elsewhere the
    rules measured before (every architecture's)."""
    gmmw = Variant("gmmw", bn=64, bt=64, step=128, ctas=2, stages=2)
    pipe = Variant("mm_pipe", bn=64, bt=64, step=256, stages=3)
    for t in (33, 48, 64):
        assert qd.choose("Q4_K", *GATE, t, "sm_90") == gmmw
        assert qd.choose("Q6_K", *QO, t, "sm_90") == gmmw
        assert qd.choose("Q4_K", *GATE, t, "sm_89") == pipe
        assert qd.choose("Q6_K", *QO, t, "sm_120") is None
    assert qd.choose("Q4_K", *GATE, 65, "sm_90") is None  # past 64: the default path
    assert qd.choose("Q4_K", *GATE, 32, "sm_90") is None
    assert qd.choose("Q4_K", *KV, 64, "sm_90") == "dense"  # k/v (small): as before
    assert qd.choose("Q5_K", *GATE, 64, "sm_90") is None  # not swept


def _rule_cases() -> list[tuple[str, int, int]]:
    cases = []
    for i, r in enumerate(qd.RULES):
        for ggml_type in r.types or ("Q4_K", "Q5_K"):
            cases += [(ggml_type, i, t) for t in sorted({r.t_min, min(r.t_max, r.t_min + 4)})]
    return cases


@pytest.mark.parametrize(("ggml_type", "rule", "t"), _rule_cases())
def test_rule_kernels_match_the_reference(
    ggml_type: str, rule: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rule's kernel, reached through qlinear: the small weight is put in the rule's class
    by moving the class bounds (a rule of an architecture: qlinear here runs what this device's
    rules give, also right)."""
    r = qd.RULES[rule]
    bounds = {"small": (1 << 40, 1 << 41), "mid": (1, 1 << 40), "large": (1, 2)}[r.shapes[-1]]
    monkeypatch.setattr(qd, "SMALL_MAX", bounds[0])
    monkeypatch.setattr(qd, "MID_MAX", bounds[1])
    raw, pw = make_weight(ggml_type, 37, 768, seed=rule * 7 + t)
    assert qd.choose(ggml_type, 37, 768, t, *r.archs[:1]) == r.kernel
    x = torch.randn(t, 768, device=DEVICE)
    y = tq.qlinear_triton(x, pw, int(pw.ggml_type), (37, 768))
    assert_close(y, x, raw, ggml_type)


def test_variant_names_parse_back() -> None:
    from hetero.kernels import triton_qvariants as tv

    for v in (Variant("mm_t", bn=64, bt=64, step=128, ctas=4, stages=3, regs=168),
              Variant("gemv", bn=32, split=2), Variant("tokens", bn=16, ctas=8)):  # fmt: skip
        assert tv.parse(v.name) == v
    for bad in ("mm_t:bn64bt64", "nope:bn64:k256:c4:w4:st1", "mm:bn64bt16:k256:c4:w4:x3"):
        with pytest.raises(ValueError):
            tv.parse(bad)


def test_a_sweep_becomes_rules_the_dispatch_reads(tmp_path, monkeypatch) -> None:
    """benchmarks/qsweep_rules.py: per type and shape class the candidate least in time summed
    over the class's shapes (correct on all of them) where it beats auto by the gain asked; the
    file's rules come before RULES in choose()."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "qsweep_rules.py"
    spec = importlib.util.spec_from_file_location("qsweep_rules", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = "mm_t:bn64bt64:k128:c4:w4:st3", "mm_pipe:bn64bt64:k256:c4:w4:st3:r168"

    def row(ty, shape, variant, us, ok=True, t=64):
        return {"type": ty, "shape": shape, "T": t, "variant": variant, "us": us, "ok": ok}

    rows = [
        row("Q4_K", "gateup2", "auto", 90.0), row("Q4_K", "down", "auto", 60.0),
        row("Q4_K", "gateup2", a, 50.0), row("Q4_K", "down", a, 70.0),  # 120 against 150
        row("Q4_K", "gateup2", b, 40.0), row("Q4_K", "down", b, 1.0, ok=False),  # not on all
        row("Q4_K", "qo", "auto", 10.0), row("Q4_K", "qo", a, 9.8),  # mid: 1.02x, no rule
        row("Q6_K", "gateup2", "auto", 100.0), row("Q6_K", "gateup2", "dense", 80.0),
        row("Q6_K", "gateup2", a, 10.0, t=32),  # another T
    ]  # fmt: skip
    rules, lines = mod.rules_from(rows, 64, 33, 64, 1.05)
    assert rules == [
        {"types": ["Q4_K"], "shapes": ["large"], "t_min": 33, "t_max": 64, "kernel": a},
        {"types": ["Q6_K"], "shapes": ["large"], "t_min": 33, "t_max": 64, "kernel": "dense"},
    ]
    assert len(lines) == 3
    f = tmp_path / "rules.json"
    f.write_text(json.dumps(rules))
    extra = qd.extra_rules(str(f))
    assert [r.kernel for r in extra] == [Variant("mm_t", 64, 64, 128, 0, 4, 4, 3), "dense"]
    assert qd.choose("Q4_K", *GATE, 64) == Variant("mm_pipe", bn=64, bt=64, step=256, stages=3)
    # a sweep's rules name its architecture: read back, they apply there alone
    named, _ = mod.rules_from(rows, 64, 33, 64, 1.05, ["sm_90"])
    assert [r["archs"] for r in named] == [["sm_90"], ["sm_90"]]
    f.write_text(json.dumps(named))
    qd.extra_rules.cache_clear()
    try:
        assert [r.archs for r in qd.extra_rules(str(f))] == [("sm_90",), ("sm_90",)]
        monkeypatch.setenv("HETERO_QDISPATCH", str(f))
        qd.extra_rules.cache_clear()
        assert qd.choose("Q6_K", *GATE, 64, "sm_90") == "dense"
        assert qd.choose("Q6_K", *GATE, 64, "sm_89") is None
    finally:
        monkeypatch.delenv("HETERO_QDISPATCH")
        qd.extra_rules.cache_clear()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**rules[0], "shapes": ["huge"]}]))
    with pytest.raises(ValueError, match="huge"):
        qd.extra_rules(str(bad))


def test_a_gluon_rule_where_gluon_does_not_run_takes_the_default_path(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule naming the Gluon dense kernel (`gmm`: compiled only, never interpreted) on a
    device without it: qlinear runs the default path instead, right against the reference."""
    import json

    from hetero.kernels import triton_qvariants as tv

    v = Variant("gmm", bn=64, bt=16, step=128)
    rule = {"types": ["Q4_K"], "shapes": ["small"], "t_min": 3, "t_max": 20, "kernel": v.name}
    f = tmp_path / "rules.json"
    f.write_text(json.dumps([rule]))
    monkeypatch.setenv("HETERO_QDISPATCH", str(f))
    qd.extra_rules.cache_clear()  # (read once a process: earlier tests read none)
    try:
        raw, pw = make_weight("Q4_K", 37, 768, seed=3)
        assert qd.choose("Q4_K", 37, 768, 16) == v and tv.variant_ok(v, pw)
        x = torch.randn(16, 768, device=DEVICE)
        assert not tv.runs_here(v, x, pw)  # float32 x, and no Gluon under the interpreter
        assert not tv.runs_here(v, x.to(torch.bfloat16), pw)
        assert_close(tq.qlinear_triton(x, pw, int(pw.ggml_type), (37, 768)), x, raw, "Q4_K")
    finally:
        monkeypatch.delenv("HETERO_QDISPATCH")
        qd.extra_rules.cache_clear()
