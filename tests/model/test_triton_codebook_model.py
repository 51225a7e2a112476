"""A whole model on the Triton quantized matmul for the codebook types (IQ4_NL, IQ4_XS, MXFP4):
every matrix of a tiny llama in one type, loaded in "quant" mode with the Triton qlinear
selected, its weights repacked at load time; its logits equal the dense reference's.

Without CUDA the kernels run under Triton's interpreter (forced through `registry.forcing`).
"""

from __future__ import annotations

import pytest

from hetero.config import RuntimeConfig
from hetero.kernels.registry import forcing
from hetero.kernels.repack import PackedWeight
from hetero.model.llama import load_model
from tests.model.test_iq_models import PROMPT, last_logits, write_tiny
from tests.support.triton_interp import DEVICE, kernels_runnable, rerun_test  # noqa: F401 (autouse)

triton = pytest.importorskip("triton")
test_in_a_fresh_interpreter_process = rerun_test(__file__)


@pytest.mark.parametrize("ggml_type", ["IQ4_NL", "IQ4_XS", "MXFP4"])
def test_triton_qlinear_model_matches_dense(tmp_path, ggml_type: str) -> None:
    path = write_tiny(tmp_path / f"{ggml_type}.gguf", ggml_type)
    rt = dict(device=str(DEVICE), dtype="fp32")
    _, dense = load_model(path, RuntimeConfig(weights="dense", **rt))
    ref = last_logits(dense, PROMPT).float().cpu()
    with forcing({"qlinear": "triton"}):
        _, model = load_model(path, RuntimeConfig(weights="quant", **rt))
        assert isinstance(model.blocks[0].ffn.down.qweight, PackedWeight)
        got = last_logits(model, PROMPT).float().cpu()
    # float32 sums in another order: a few ulps of the largest terms
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-5
