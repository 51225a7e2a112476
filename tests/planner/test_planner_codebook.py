"""The CPU's cost of the codebook types on qdot (IQ4_NL, IQ4_XS, MXFP4: kernels/cpu_qcodebook.c):
each tensor at the rate the profile measured for its own type ("qdot:<type>", which the
profiler times: hetero/profiler/measure.py's QDOT_TYPES), never at Q4_1's "qdot" rate, matrices
and experts alike, and a plan's predicted decode follows that rate. Made-up profiles,
`hetero synth` shapes described without writing them."""

from __future__ import annotations

import pytest

from hetero.planner.cost import DeviceCost
from hetero.planner.model_desc import describe, weight_bytes
from hetero.planner.plan import PlanConfig, plan
from tests.planner.test_planner import cpu

Q4_1_RATE = (20.0, 0.2)  # "qdot": GB/s at T = 1, TFLOP/s at a prompt's T


def on_qdot(**rates: tuple[float, float]):
    """tests/planner's made-up CPU with a qdot rate ("qdot", Q4_1's) and one per named type."""
    from hetero.planner.device import MatmulRate

    matmul = {"qdot": MatmulRate("cpu-qdot", *Q4_1_RATE)}
    matmul |= {f"qdot:{t}": MatmulRate("cpu-qdot", *r) for t, r in rates.items()}
    base = cpu()
    return base.replace(matmul={**base.matmul, **matmul})


@pytest.mark.parametrize(("quant", "ggml_type"), [("iq4_nl", "IQ4_NL"), ("iq4_xs", "IQ4_XS")])
def test_codebook_matrices_run_at_their_own_measured_rate(quant, ggml_type):
    desc = describe(f"synth:llama3-8b:{quant}")
    q = next(t for t in desc.layers[0] if t.name.endswith("attn_q.weight"))
    assert q.ggml_type == ggml_type
    nbytes = weight_bytes(q, "qdot", on_cpu=True)
    cost = DeviceCost(desc, on_qdot(**{ggml_type: (5.0, 0.05)}), "qdot", "fp16")
    assert cost.linear_seconds(q, 1) == pytest.approx(nbytes / 5e9)
    assert cost.linear_seconds(q, 512) == pytest.approx(2 * 512 * q.params / 0.05e12)
    # a profile without the type's rate (measured before the profiler timed it) falls back
    old = DeviceCost(desc, on_qdot(), "qdot", "fp16")
    assert old.linear_seconds(q, 1) == pytest.approx(nbytes / (Q4_1_RATE[0] * 1e9))


def test_mxfp4_experts_on_the_cpu_run_at_the_mxfp4_rate():
    desc = describe("synth:tiny-gpt-oss:mxfp4_moe")
    gate = next(t for t in desc.layers[0] if t.name.endswith("ffn_gate_exps.weight"))
    assert gate.ggml_type == "MXFP4" and gate.is_expert
    e, k = desc.config.n_experts, desc.config.n_experts_used
    rate = on_qdot(MXFP4=(4.0, 0.04)).matmul["qdot:MXFP4"]
    cost = DeviceCost(desc, on_qdot(MXFP4=(4.0, 0.04)), "qdot", "fp16")
    # one token reads its k experts, each at the MXFP4 rate
    want = k * rate.seconds(weight_bytes(gate, "qdot", True) / e, gate.params / e, 1)
    assert cost.linear_seconds(gate, 1) == pytest.approx(want)
    fallback = DeviceCost(desc, on_qdot(), "qdot", "fp16")
    assert fallback.linear_seconds(gate, 1) < cost.linear_seconds(gate, 1)


def test_a_plan_predicts_decode_from_the_types_measured_rate():
    """One CPU, an IQ4_XS file: halving the measured IQ4_XS rate slows the predicted decode (a
    Q4_K_M file on the same profiles does not see it); measured slower than the fp16 repack
    (40 GB/s of 2 bytes a weight here), the stage runs fp16 instead."""
    fast, slow, slower = (on_qdot(IQ4_XS=(r, r / 100)) for r in (30.0, 15.0, 4.0))
    iq4 = describe("synth:llama3-8b:iq4_xs")
    a, b = plan(iq4, [fast], PlanConfig()), plan(iq4, [slow], PlanConfig())
    assert a.stages[0].weights == b.stages[0].weights == "qdot"
    assert b.single_stream_tok_s < 0.8 * a.single_stream_tok_s
    assert plan(iq4, [slower], PlanConfig()).stages[0].weights == "fp16"
    q4k = describe("synth:llama3-8b:q4_k_m")
    c, d = plan(q4k, [fast], PlanConfig()), plan(q4k, [slow], PlanConfig())
    assert c.single_stream_tok_s == pytest.approx(d.single_stream_tok_s)
