"""The fp32 forward pass against HF transformers, which dequantizes GGUF files exactly to float32.

SmolLM2 in its shipped Q4_1 and re-quantized to Q8_0, Q6_K and Q5_K_M; tiny random qwen2/qwen3/
llama models from `hetero synth`. Top-20 next-token logits must agree within 1e-2 and greedy
continuations token for token.
"""

from __future__ import annotations

import os

import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.generate import generate_ids
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
TOL = 1e-2
GREEDY_TOKENS = 24


def _hf(path):
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    kv = ContiguousKV(model.config, len(ids), torch.float32)
    kv.begin(len(ids))
    batch = ForwardBatch(torch.arange(len(ids)), torch.tensor([len(ids) - 1]), kv)
    return model(torch.tensor(ids), batch)[0]


def compare(path, prompts, weights="dense") -> float:
    """Max |logit difference| over HF's top-20 for each prompt; asserts greedy agreement."""
    hf_tok, hf = _hf(path)
    _, ours = load_model(path, RuntimeConfig(weights=weights, allow_reference=True))
    worst = 0.0
    for text in prompts:
        ids = hf_tok(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        got = _last_logits(ours, ids)
        top = ref.topk(20).indices
        worst = max(worst, (got[top] - ref[top]).abs().max().item())
        assert torch.equal(got.topk(5).indices, ref.topk(5).indices)
        with torch.no_grad():
            hf_out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        our_out = list(generate_ids(ours, ids, GREEDY_TOKENS))
        assert our_out == hf_out, f"greedy continuation of {text!r} differs"
    assert worst < TOL, f"top-20 logits differ by {worst:.2e} (> {TOL})"
    return worst


@pytest.fixture(scope="module")
def smollm2_variants(smollm2_path, tmp_path_factory):
    from hetero.requantize import requantize

    out = {"q4_1": smollm2_path}
    folder = tmp_path_factory.mktemp("requant")
    for qtype in ("q8_0", "q6_k", "q5_k_m"):
        out[qtype] = folder / f"smollm2-{qtype}.gguf"
        requantize(smollm2_path, out[qtype], qtype, progress=False)
    return out


@pytest.mark.parametrize("variant", ["q4_1", "q8_0", "q6_k", "q5_k_m"])
def test_smollm2_matches_transformers(smollm2_variants, variant, record_property):
    worst = compare(smollm2_variants[variant], PROMPTS)
    record_property("max_top20_logit_error", worst)
    print(f"SmolLM2 {variant}: max |top-20 logit error| = {worst:.2e}")


def test_quant_weights_path_matches_transformers(smollm2_path):
    """The reference path (weights kept in GGUF blocks, dequantized per call) agrees too."""
    compare(smollm2_path, PROMPTS[:1], weights="quant")


@pytest.mark.parametrize(
    "shape,quant", [("tiny-llama", "q4_k_m"), ("tiny-qwen2", "q6_k"), ("tiny-qwen3", "q8_0")]
)
def test_synthetic_architectures_match_transformers(tmp_path, shape, quant):
    from hetero.synth import write_synthetic

    path = write_synthetic(tmp_path / f"{shape}.gguf", shape, quant, seed=1, progress=False)
    compare(path, ["hello world, this is a test", "def f(x):\n    return x * 2\n"])
