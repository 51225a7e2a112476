"""Kernel variants of the sweep (hetero.kernels.triton_qvariants) against the torch reference.

Under Triton's interpreter on a CPU (small shapes), compiled on a CUDA device. K = 768 is three
K-quant super-blocks: with two splits the last is short (the case whose empty steps the
pipelined kernels no longer run); odd N masks rows; T = 3 and 17 mask tokens.
"""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import triton_qvariants as tv
from tests.kernels.test_triton_qmatmul import assert_close, make_weight
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401  (autouse fixture)

test_in_a_fresh_interpreter_process = rerun_test(__file__)

# Q4_K / Q5_K (mins, a high plane), Q6_K (two groups a chunk), Q8_0 (a group spans chunks),
# IQ4_XS (a codebook, K-quant scales), MXFP4 (a codebook, E8M0 scales),
# Q2_K (four groups a chunk, packed mins), Q4_1 (legacy mins)
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q2_K", "Q4_1", "IQ4_XS", "MXFP4"]


def _check(ggml_type: str, v: tv.Variant, tokens: tuple[int, ...], k: int = 768) -> None:
    raw, pw = make_weight(ggml_type, 37, k, seed=k + len(v.name))
    assert tv.variant_ok(v, pw), v.name
    for t in tokens:
        x = torch.randn(t, k, device=DEVICE)
        assert_close(tv.run(x, pw, v), x, raw, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_pipelined_decode_kernel(ggml_type: str) -> None:
    """Scales prefetched with the words: split 2 (a short last split), and whole; 2 steps of 128
    codes a super-block."""
    _check(ggml_type, tv.Variant("gemv_pipe", bn=16, split=2), (1, 3))
    _check(ggml_type, tv.Variant("gemv_pipe", bn=32, step=128, split=1), (1,))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_pipelined_tensor_core_kernel(ggml_type: str) -> None:
    x_dtype = torch.float16
    raw, pw = make_weight(ggml_type, 37, 768, seed=11)
    for t, v in ((17, tv.Variant("mm_pipe", bn=32, bt=16, step=128, split=2)),
                 (3, tv.Variant("mm_pipe", bn=16, bt=16, step=256, split=1)),
                 (17, tv.Variant("mm_t", bn=32, bt=16, step=128, split=2)),
                 (3, tv.Variant("mm_t", bn=16, bt=16, step=256, split=1))):  # fmt: skip
        x = torch.randn(t, 768, device=DEVICE).to(x_dtype)
        assert_close(tv.run(x, pw, v), x, raw, ggml_type)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q8_0"])
def test_original_kernels_under_other_configs(ggml_type: str) -> None:
    """The sweep's configs of the kernels qlinear runs: steps, tiles and splits it never picks."""
    _check(ggml_type, tv.Variant("gemv", bn=16, step=128, split=3), (1,))
    _check(ggml_type, tv.Variant("tokens", bn=16, split=2), (5,))
    raw, pw = make_weight(ggml_type, 37, 768, seed=12)
    x = torch.randn(9, 768, device=DEVICE).to(torch.float16)
    assert_close(
        tv.run(x, pw, tv.Variant("mm", bn=16, bt=16, step=256, split=2)), x, raw, ggml_type
    )


def test_variant_ok_refuses_steps_across_super_blocks() -> None:
    _, pw = make_weight("Q4_K", 16, 512, seed=0)
    assert not tv.variant_ok(tv.Variant("gemv", step=512), pw)
    assert not tv.variant_ok(tv.Variant("gemv", step=48), pw)
    assert not tv.variant_ok(tv.Variant("nope"), pw)
    assert tv.variant_ok(tv.Variant("mm_pipe", bn=32, bt=16, step=128), pw)
    with pytest.raises(ValueError, match="cannot run"):
        tv.run(torch.zeros(1, 512, device=DEVICE), pw, tv.Variant("gemv", step=512))
