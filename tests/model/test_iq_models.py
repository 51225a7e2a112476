"""Models whose weights are IQ or MXFP4 blocks load and run on the CPU.

A tiny llama (2 layers, width 256, GQA) is written with gguf.GGUFWriter (`hetero synth`'s
"pure-TYPE" mix), every matrix (the embedding and output head included) in one of the new types
as random finite blocks. Its logits in the CPU weights modes equal those of the dense reference
(the weights dequantized exactly, bit for bit as gguf.quants) within the mode's own rounding:
"quant" multiplies the same float32 weights, "auto" (qdot mode, the CPU default,
kernels/cpu_qdot.cpu_scheme) runs the codebook types (IQ4_NL, IQ4_XS, MXFP4) on the qdot kernel,
which rounds the activations to int8 per block, and rounds the grid types' weights to fp16;
"int8" rounds the weights to 8 bits a row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, quants

from hetero.config import RuntimeConfig
from hetero.kernels.cpu_qdot import cpu_scheme
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from hetero.synth_shapes import ModelShape

NEW_TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"]
NEW_TYPES += ["IQ3_XXS", "IQ3_S"]
SHAPE = ModelShape(
    arch="llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
    vocab_size=384, context_length=256, rope_theta=10000.0, norm_eps=1e-5, tied_embeddings=False,
)  # fmt: skip
PROMPT = [5, 17, 99, 3, 250, 41, 7]
# max |logit - dense| / std(dense logits) a mode may reach. Measured worst over the ten types
# (seed 0): quant 0 (the same float32 weights), fp16 2.3e-3, auto 2.3e-3 (the grid types: qdot
# mode runs them fp16), bf16 3.0e-2, int8 7.7e-2 (8 bits a row, across blocks whose scales
# differ). int4 (4-bit min/max groups of a 4-bit codebook: 0.24-0.88) is left out: the loader's
# error budget keeps it from these types unless asked for.
MODE_TOL = {"quant": 1e-6, "auto": 6e-3, "int8": 0.12}
# "auto" where qdot reads the type's blocks: activations rounded per 32 (IQ4_NL 3.4e-2, MXFP4
# 4.7e-2) or per 256 (IQ4_XS 5.9e-2), measured with seed 0
QDOT_TOL = 0.1


def write_tiny(path: Path, ggml_type: str, shape: ModelShape = SHAPE) -> Path:
    """A llama GGUF of `shape`, every matrix random blocks of `ggml_type` (`hetero synth`'s
    pure mix, written with gguf.GGUFWriter)."""
    return write_synthetic(path, shape, f"pure-{ggml_type.lower()}", progress=False)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    kv = ContiguousKV(model.config, len(ids), torch.float32)
    kv.begin(len(ids))
    batch = ForwardBatch(torch.arange(len(ids)), torch.tensor([len(ids) - 1]), kv)
    with torch.no_grad():
        return model(torch.tensor(ids), batch)[0]


@pytest.mark.parametrize("ggml_type", NEW_TYPES)
def test_every_cpu_weights_mode_matches_the_dense_reference(tmp_path: Path, ggml_type: str):
    path = write_tiny(tmp_path / f"{ggml_type}.gguf", ggml_type)
    reader = GGUFReader(path)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert {t.tensor_type.name for t in matrices} == {ggml_type}
    _, dense = load_model(path, RuntimeConfig(weights="dense"))
    embd = reader.tensors[0]
    assert embd.name == "token_embd.weight"
    exact = quants.dequantize(embd.data, embd.tensor_type)[PROMPT]
    assert torch.equal(dense.embed(torch.tensor(PROMPT)), torch.from_numpy(exact))
    ref = last_logits(dense, PROMPT)
    assert torch.isfinite(ref).all() and ref.std() > 0
    for mode, tol in MODE_TOL.items():
        tol = QDOT_TOL if mode == "auto" and cpu_scheme(ggml_type) == "qdot" else tol
        _, model = load_model(path, RuntimeConfig(weights=mode, allow_reference=True))
        err = (last_logits(model, PROMPT) - ref).abs().max().item() / ref.std().item()
        assert err <= tol, f"{ggml_type} {mode}: {err:.2e} of the logits' std (> {tol})"
