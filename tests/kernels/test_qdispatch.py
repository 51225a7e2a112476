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
    by moving the class bounds."""
    r = qd.RULES[rule]
    bounds = {"small": (1 << 40, 1 << 41), "mid": (1, 1 << 40), "large": (1, 2)}[r.shapes[-1]]
    monkeypatch.setattr(qd, "SMALL_MAX", bounds[0])
    monkeypatch.setattr(qd, "MID_MAX", bounds[1])
    raw, pw = make_weight(ggml_type, 37, 768, seed=rule * 7 + t)
    assert qd.choose(ggml_type, 37, 768, t) == r.kernel
    x = torch.randn(t, 768, device=DEVICE)
    y = tq.qlinear_triton(x, pw, int(pw.ggml_type), (37, 768))
    assert_close(y, x, raw, ggml_type)
