"""What the server learns of a loaded engine (frontdoor/wire.py's EngineInfo): the most tokens
one request's KV can hold. A dense model's: the whole pool. With sliding-window layers the pool's
blocks serve two KV cache groups (engine/kv_groups.py): the full group's tables may take what the
window group's never needs, its window and one step."""

from __future__ import annotations

import pytest

from hetero.frontdoor.wire import EngineInfo
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from tests.support import exact_weights


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gpt-oss"])
def test_pool_tokens_count_every_kv_cache_group(tmp_path, shape):
    path = write_synthetic(tmp_path / "m.gguf", shape, "q8_0", progress=False)
    llm = LLM(str(path), loaded=load_model(path, exact_weights.runtime()), num_kv_blocks=64,
              block_size=4, kv_dtype="fp32", max_num_batched_tokens=16, max_num_seqs=2)  # fmt: skip
    info = EngineInfo.of(llm.engine)
    if shape == "tiny-llama":
        assert info.pool_tokens == 64 * 4
        return
    # window 8, steps of 16: the window group holds 2 + 4 + 1 blocks, the full group the rest
    assert info.pool_tokens == (64 - 7) * 4
    bm = llm.engine.block_manager
    assert bm.blocks_needed(info.pool_tokens, 16) == 64
    assert bm.blocks_needed(info.pool_tokens + 4, 16) == 65
