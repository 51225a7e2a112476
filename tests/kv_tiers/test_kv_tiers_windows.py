"""The lower KV tiers with a sliding-window KV cache group (engine/kv_groups.py): a window
group's blocks move to RAM and disk and come back by their own names, a hit whose window block
cannot be claimed shrinks to where the window still is (giving back the claims it no longer
takes), and gpt-oss's cached prefixes survive a restart on disk.
"""

from __future__ import annotations

import os

import pytest

from hetero.engine.kv_groups import group_name
from hetero.engine.request import Request
from hetero.kv_tiers.policy import KVTiers
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from tests.kv_tiers.test_kv_tiers import Rig, chain_names, reference


@pytest.mark.parametrize("bad", [1, 4], ids=["last", "all-on-disk"])
def test_window_blocks_that_cannot_be_claimed_shorten_the_hit(tmp_path, bad):
    """Layer 0 has a window of 3: a hit of n blocks of 2 needs window block n - 1. The prefix
    goes to RAM (blocks 0 .. 3 of both groups) and disk (4 .. 7); then the disk files of the
    last `bad` window blocks go bad before anything read them ahead. allocate claims in chain
    order, fails at such a file, and matches again without it, claiming what the shorter hit
    needs in turn: one block shorter with the last one bad, 4 blocks (window block 3 from
    RAM) with all those on disk bad. Either way the request reads its own KV."""
    rig = Rig(num_blocks=24, block_size=2, ram_slots=8, disk_dir=tmp_path, disk_blocks=64,
              window=3)  # fmt: skip
    prompt = [(7 * i + 3) % 50 for i in range(17)]
    rig.add("a", prompt, 1)
    rig.run()
    rig.bm.evict_parked()
    rig.mover.run(rig.tiers.take_ops())
    req = Request("b", prompt + [1, 2], None)
    hit = rig.bm._match(req)
    assert hit.n == 8 and [b.where for b in hit.blocks] == ["ram"] * 4 + ["disk"] * 5
    names = chain_names(prompt, 2)
    for i in range(8 - bad, 8):
        name = group_name(3, names[i])
        assert rig.tiers.where(name) == "disk"
        rig.tiers.disk._path(name).write_bytes(b"not a block")
    assert rig.bm.allocate(req)
    rig.bm.check()  # the RAM pins left are exactly the restore's own
    n = 8 - bad
    assert req.num_computed_tokens == 2 * n
    assert rig.bm._cache.lookup(group_name(3, names[n - 1])) == req.block_tables[1][n - 1]
    rig.mover.run(rig.tiers.take_ops())
    rig.bm.finish_restores(rig.mover.wait() if rig.mover.busy else rig.mover.poll())
    rig.bm.free(req)
    rig.bm.check()
    assert not rig.tiers.ram._pins
    again = prompt + [1, 2]
    rig.add("c", again, 3)
    rig.run()
    assert rig.outputs["c"] == reference(again, 3)


def test_claims_given_back_unpin_their_ram_slots():
    tiers = KVTiers(3, None, 100)
    names = [bytes([i]) * 32 for i in range(3)]
    for i, h in enumerate(names):
        tiers.evicted(i, h)
    claimed = tiers.claim(names)
    assert len(tiers.ram._pins) == 3
    tiers.unclaim(claimed[1:])
    ticket = tiers.restore(claimed[:1], [7])
    tiers.check()  # the one pin left is the restore's
    tiers.restored(ticket)
    assert not tiers.ram._pins


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hetero.config import RuntimeConfig
    from tests.support.moe_models import tiny_gpt_oss, write_gguf

    path = write_gguf(tiny_gpt_oss(seed=1), tmp_path_factory.mktemp("swa") / "gpt-oss.gguf")
    return path, load_model(path, RuntimeConfig(device="cpu", weights="dense"))


def test_gpt_oss_prefixes_come_back_from_disk_after_a_restart(gpt_oss, tmp_path):
    path, loaded = gpt_oss
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = [(31 * i + 5) % 500 for i in range(29)]

    def llm(**kw) -> LLM:
        return LLM(str(path), loaded=loaded, num_kv_blocks=64, block_size=4, kv_dtype="fp32",
                   speculative="off", **kw)  # fmt: skip

    cold = llm(enable_prefix_caching=False).generate([prompt], params)[0].outputs[0]
    first = llm(kv_ram_gb=0.0, kv_disk_dir=str(tmp_path))
    assert first.generate([prompt], params)[0].outputs[0].token_ids == cold.token_ids
    assert first.engine.save_kv_cache() > 0
    second = llm(kv_ram_gb=0.0, kv_disk_dir=str(tmp_path))
    out = second.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == cold.token_ids
    got = [lp.logprob for lp in out.outputs[0].logprobs]
    assert got == pytest.approx([lp.logprob for lp in cold.logprobs], abs=1e-5)
    assert out.num_cached_tokens == 28  # 7 full blocks, and the window's last 2
    assert second.engine.kv_tiers.tiers.stats.hits["disk"] == 7 + 2
    second.engine.block_manager.check()
