"""The engine heals its disk tier: a saved prefix whose file went bad between runs is recomputed
from there, and its good copy is written as soon as the block is computed again (not at
shutdown), so the next engine, even after a crash, restores the whole prefix.
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import pytest

from hetero.engine.prefix_cache import block_hash
from hetero.llm import LLM
from hetero.model.llama import load_model
from hetero.sampling import SamplingParams
from hetero.synth import write_synthetic
from tests.support import exact_weights

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
B = 8  # block size
HIT = 88  # 90 prompt tokens: 11 full blocks (one token is always computed)
BAD = 4  # the chain position damaged


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic(
        tmp_path_factory.mktemp("heal") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )
    return path, load_model(path, exact_weights.runtime())


def engine(model, disk) -> LLM:
    path, loaded = model
    return LLM(str(path), loaded=loaded, num_kv_blocks=16, block_size=B, kv_dtype="fp32",
               kv_ram_gb=0.0, kv_disk_dir=str(disk))  # fmt: skip


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 4000) for _ in range(89)]


def chain(ids: list[int]) -> list[bytes]:
    names, prev = [], None
    for i in range(len(ids) // B):
        prev = block_hash(prev, ids[i * B : (i + 1) * B])
        names.append(prev)
    return names


def run(llm: LLM, ids: list[int]):
    out = llm.generate([ids], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def damage_flip(p, other):
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01
    p.write_bytes(bytes(data))


def damage_truncate(p, other):
    os.truncate(p, p.stat().st_size // 2)


def damage_delete(p, other):
    p.unlink()


def damage_foreign(p, other):
    shutil.copyfile(other, p)  # another block's file under this name


def damage_directory(p, other):
    p.unlink()
    p.mkdir()


DAMAGE = [damage_flip, damage_truncate, damage_delete, damage_foreign, damage_directory]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__[7:])
def test_a_damaged_prefix_file_is_recomputed_and_written_again(model, tmp_path, damage):
    ids, disk = prompt(seed=11), tmp_path / "kv"
    first = engine(model, disk)
    want = run(first, ids)
    assert first.engine.save_kv_cache() == 11
    names = chain(ids)
    (folder,) = disk.iterdir()
    files = [folder / f"{h.hex()}.kv" for h in names]
    good = files[BAD].read_bytes()
    damage(files[BAD], files[BAD + 1])

    second = engine(model, disk)
    got = run(second, ids)
    assert got == (want[0], BAD * B)  # the same answer; the hit ends before the bad block
    # the good copy is back while the engine runs: nothing was saved at a shutdown
    assert files[BAD].read_bytes() == good
    assert not second.engine.kv_tiers.tiers.disk.lost

    third = engine(model, disk)  # the next start (the second never shut down)
    assert run(third, ids) == (want[0], HIT)
    assert third.engine.kv_tiers.tiers.stats.hits["disk"] == 11
    third.engine.block_manager.check()


def test_healing_stops_at_the_end_of_what_was_saved(model, tmp_path):
    """A chain saved only up to some block is not a gap: nothing past it is written through."""
    ids, disk = prompt(seed=12), tmp_path / "kv"
    first = engine(model, disk)
    run(first, ids[: 5 * B + 1])  # 5 full blocks
    assert first.engine.save_kv_cache() == 5
    second = engine(model, disk)
    assert run(second, ids)[1] == 5 * B
    assert len(list(disk.rglob("*.kv"))) == 5  # no write-through of blocks 5..10


def test_a_ram_tier_larger_than_the_machine_shrinks_and_serves(model, tmp_path, caplog):
    """64 TiB of RAM tier asked: the host refuses it, the tier shrinks with a warning, and the
    engine starts, offloads and restores from what it got."""
    path, loaded = model
    with caplog.at_level(logging.WARNING, logger="hetero.kv_tiers"):
        llm = LLM(str(path), loaded=loaded, num_kv_blocks=16, block_size=B, kv_dtype="fp32",
                  kv_ram_gb=65536.0)  # fmt: skip
    assert "cannot be had" in caplog.text
    kv = llm.engine.kv_tiers
    asked = kv.plan.ram_slots
    assert 0 < kv.host.num_slots < asked and kv.tiers.ram.num_slots == kv.host.num_slots
    ids = prompt(seed=13)
    want = run(llm, ids)
    assert kv.offload_all(llm.engine.block_manager) == 11
    assert run(llm, ids) == (want[0], HIT)
    assert kv.tiers.stats.hits["ram"] == 11
    assert llm.engine.gauges().tiers.ram_slots == kv.host.num_slots
