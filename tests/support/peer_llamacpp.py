"""Run by a Python that has llama-cpp-python (not hetero's): logits of token ids from a GGUF.

    python peer_llamacpp.py MODEL.gguf IDS_JSON OUT.npy [KV_TYPE]

Writes llama.cpp's logits [len(ids), V] float32 for every position (CPU, one batch). KV_TYPE is
a ggml type id for the KV cache (0: F32, the exact path; 1: F16, llama.cpp's default).
"""

from __future__ import annotations

import json
import sys

import llama_cpp
import numpy as np


def main() -> None:
    path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    kv = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=max(64, 2 * len(ids)), n_batch=len(ids), logits_all=True,
        n_gpu_layers=0, type_k=kv, type_v=kv, flash_attn=False, verbose=False,
    )  # fmt: skip
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))


if __name__ == "__main__":
    main()
