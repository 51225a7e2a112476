"""Random expert weights as GGUF blocks, for the MoE kernel tests."""

from __future__ import annotations

import numpy as np
import torch

from hetero.quant import get_quant, random_blocks


def random_experts(
    ggml_type: str, e: int, n: int, k: int, seed: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random GGUF blocks of W [e, n, k]: uint8 [e, n, row bytes] on `device`."""
    qt = get_quant(ggml_type)
    blocks = random_blocks(ggml_type, e * n * k // qt.block_size, np.random.default_rng(seed))
    return torch.from_numpy(blocks).reshape(e, n, -1).to(device)
