"""The rows whose logits a forward returns: an index tensor, or a slice (a CUDA graph's bucket of
one row hands its row 0 as a view: no gathers of the hidden states and the last block's delta).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hetero.config import RuntimeConfig
from hetero.model.contiguous_kv import ContiguousKV
from hetero.model.forward_batch import ForwardBatch
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from tests.model.test_iq_models import SHAPE


def test_logit_rows_as_a_slice_equal_an_index(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "tiny.gguf", SHAPE, "q4_k_m", progress=False)
    _, model = load_model(path, RuntimeConfig(weights="dense", allow_reference=True))
    ids = [5, 17, 99]
    got = []
    for rows in (torch.tensor([1, 2]), slice(1, 3)):
        kv = ContiguousKV(model.config, len(ids), torch.float32)
        kv.begin(len(ids))
        with torch.no_grad():
            got.append(model(torch.tensor(ids), ForwardBatch(torch.arange(3), rows, kv)))
    assert got[0].shape == (2, SHAPE.vocab_size)
    assert torch.equal(got[0], got[1])
