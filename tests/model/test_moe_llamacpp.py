"""The MoE files load in llama.cpp, which computes what transformers computes: three readers.

llama.cpp runs in a Python of its own (llama-cpp-python is built from source, so it is not a
test dependency): set HETERO_LLAMA_CPP_PYTHON to an interpreter that imports `llama_cpp`, else
(unset, or no such file) these tests skip. tests/support/peer_llamacpp.py returns its logits
for every position.

- The tiny transformers models written as F32 GGUF (tests/support/moe_models.py), its KV in
  F32: its logits equal transformers' to float rounding, which checks the writer's names,
  layouts and metadata exactly. gpt-oss here takes YaRN with rounded correction dims, as
  llama.cpp rounds them; with gpt-oss's own unrounded ones (what transformers and hetero
  compute) llama.cpp differs by a few 1e-3, and that is checked too.
- gpt-oss as released (MXFP4 experts, Q8_0 attention): llama.cpp rounds activations to 8 bits
  in its quantized matmuls, a behavioural peer: the same logits up to that rounding.
- `hetero synth` files of the tiny MoE shapes (Q4_K_M, gpt-oss in MXFP4): llama.cpp loads them
  and agrees with hetero to its activation rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hetero.config import RuntimeConfig
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from tests.support.moe_models import load_weights_from, tiny_gpt_oss, tiny_qwen3moe, write_gguf

PEER = os.environ.get("HETERO_LLAMA_CPP_PYTHON")
pytestmark = pytest.mark.skipif(
    not (PEER and Path(PEER).is_file()),
    reason="no llama.cpp peer: HETERO_LLAMA_CPP_PYTHON is not set or names no interpreter",
)
pytest.importorskip("transformers")

IDS = [5, 77, 300, 12, 9, 400, 33, 21, 250, 101, 7, 8, 9, 10, 200, 201, 202, 3, 4]
YARN_ROUNDED = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
    "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
}  # fmt: skip


def llama_cpp_logits(path: Path, ids: list[int], kv_type: int = 0) -> np.ndarray:
    out = path.with_suffix(".npy")
    script = str(Path(__file__).parents[1] / "support" / "peer_llamacpp.py")
    done = subprocess.run(
        [PEER, script, str(path), json.dumps(ids), str(out), str(kv_type)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hetero_logits(path: Path, ids: list[int]) -> np.ndarray:
    _, model = load_model(path, RuntimeConfig(device="cpu", weights="quant", allow_reference=True))
    kv = ContiguousKV(model.config, len(ids), torch.float32)
    kv.begin(len(ids))
    rows = torch.arange(len(ids))
    return model(torch.tensor(ids), ForwardBatch(rows, rows, kv)).numpy()


def report(name: str, diff: np.ndarray) -> float:
    worst = float(np.abs(diff).max())
    print(f"{name}: max |logit difference| {worst:.3g}", file=sys.stderr)
    return worst


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_f32_files_give_transformers_logits(tmp_path, arch):
    model = (
        tiny_qwen3moe(seed=1)
        if arch == "qwen3moe"
        else tiny_gpt_oss(1, rope_parameters=YARN_ROUNDED)
    )
    path = write_gguf(model, tmp_path / f"{arch}.gguf")
    assert report(arch, llama_cpp_logits(path, IDS) - hf_logits(model, IDS)) < 1e-4


def test_gpt_oss_yarn_dims_unrounded_differ_only_slightly(tmp_path):
    model = tiny_gpt_oss(seed=1)
    path = write_gguf(model, tmp_path / "gpt-oss.gguf")
    diff = llama_cpp_logits(path, IDS) - hf_logits(model, IDS)
    assert 1e-4 < report("gpt-oss, YaRN dims unrounded", diff) < 3e-2


def test_gpt_oss_as_released_is_a_behavioural_match(tmp_path):
    model = tiny_gpt_oss(1, rope_parameters=YARN_ROUNDED)
    path = write_gguf(model, tmp_path / "gpt-oss-mxfp4.gguf", T.MXFP4)
    load_weights_from(model, path)
    ours, ref = llama_cpp_logits(path, IDS), hf_logits(model, IDS)
    report("gpt-oss MXFP4/Q8_0", ours - ref)
    typical = np.median(np.abs(ours - ref).max(-1))
    assert typical < 0.3, f"median over positions of the max difference: {typical:.3g}"
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.99


@pytest.mark.parametrize(("shape", "quant"), [
    ("tiny-qwen3moe", "q4_k_m"), ("tiny-gpt-oss", "q4_k_m"), ("tiny-gpt-oss", "mxfp4_moe"),
])  # fmt: skip
def test_synth_files_load_in_llama_cpp(tmp_path, shape, quant):
    path = write_synthetic(tmp_path / f"{shape}-{quant}.gguf", shape, quant, progress=False)
    ids = [1 + 97 * i % 4000 for i in range(16)]
    theirs, ours = llama_cpp_logits(path, ids, kv_type=1), hetero_logits(path, ids)
    assert np.isfinite(theirs).all()
    report(f"{shape} {quant} (hetero vs llama.cpp)", theirs - ours)
    assert np.corrcoef(theirs.ravel(), ours.ravel())[0, 1] > 0.99
