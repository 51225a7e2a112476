"""The daemon's KV tiers heal, on a real daemon and real file-system faults.

* Files damaged between two runs (a flipped byte, a truncated file, another block's file, a
  deleted one, one made unreadable, a directory in a file's place) are never loaded: the
  answers stay the same, the prefix is recomputed from the bad block on, and the good copies
  are written at once, so an engine killed right after (and started again by the daemon) finds
  whole prefixes on disk. The file permissions bind because the daemon runs without the
  capabilities that let root ignore them (capsh; file_faults.without_dac). The RAM tier asked
  for 64 TiB shrinks to what the machine gives.
* While the daemon runs, its disk tier's directory is a small tmpfs: remounted read-only, filled
  to the last byte, and deleted. Each is logged once, the daemon keeps answering (and reading
  the files it has), and writing resumes once the fault is gone.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from hetero.engine.prefix_cache import block_hash
from hetero.kv_tiers.disk_health import RETRY_S
from hetero.synth import write_synthetic
from tests.support.file_faults import fill, remount, tmpfs, without_dac
from tests.support.server_fixture import start_daemon

B = 16  # block size
BAD = 3  # the damaged block of each prompt's chain
PROMPT = 100  # tokens: 6 full blocks are a hit ((100 - 1) // 16)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_synthetic(
        tmp_path_factory.mktemp("kvheal") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def chain_files(folder: Path, prompt: list[int]) -> list[Path]:
    names, prev = [], None
    for i in range((len(prompt) - 1) // B):
        prev = block_hash(prev, prompt[i * B : (i + 1) * B])
        names.append(folder / f"{prev.hex()}.kv")
    return names


def ask(d, prompt: list[int]) -> tuple[str, int]:
    status, body = d.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def flip(p: Path, other: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x20
    p.write_bytes(bytes(data))


def truncate(p: Path, other: Path) -> None:
    os.truncate(p, p.stat().st_size - 100)


def foreign(p: Path, other: Path) -> None:
    shutil.copyfile(other, p)


def delete(p: Path, other: Path) -> None:
    p.unlink()


def unreadable(p: Path, other: Path) -> None:
    p.chmod(0)


def directory(p: Path, other: Path) -> None:
    p.unlink()
    p.mkdir()


DAMAGE = [flip, truncate, foreign, delete, unreadable, directory]
SEEN = {  # what the log says of each (a deleted file is a gap: nothing to say)
    flip: "checksum mismatch",
    truncate: "truncated",
    foreign: "header does not match",
    unreadable: "unreadable (Permission denied)",
    directory: "not a regular file",
}


def test_damaged_files_are_recomputed_and_healed_before_a_crash(model, tmp_path):
    kv = tmp_path / "kv"
    args = (str(model), "--engine-process", "--threads", "1", "--kv-dtype", "fp32",
            "--num-kv-blocks", "64", "--kv-disk-dir", str(kv), "--kv-ram-gb", "65536")  # fmt: skip
    prompts = [ids(PROMPT, seed) for seed in range(len(DAMAGE))]
    d = start_daemon(*args, wrap=without_dac)
    try:
        first = [ask(d, p) for p in prompts]
        assert all(cached == 0 for _, cached in first)
        asked, got = map(int, re.search(r"RAM tier: (\d+) blocks .* cannot be had as asked "
                                         r".*; using (\d+) blocks", d.log()).groups())  # fmt: skip
        assert 0 < got < asked  # the RAM tier shrank; the daemon runs
        assert d.metrics()['hetero_kv_tier_blocks_total{tier="ram"}'] == got
    finally:
        assert d.finish() == 0, d.log()
    (folder,) = kv.iterdir()
    files = [chain_files(folder, p) for p in prompts]
    assert all(f.is_file() for chain in files for f in chain)  # saved at shutdown
    good = [chain[BAD].read_bytes() for chain in files]
    for damage, chain in zip(DAMAGE, files):
        damage(chain[BAD], chain[BAD + 1])

    d = start_daemon(*args, wrap=without_dac)
    try:
        again = [ask(d, p) for p in prompts]
        assert [t for t, _ in again] == [t for t, _ in first]
        assert [c for _, c in again] == [BAD * B] * len(DAMAGE)  # the hit ends at the bad block
        for damage, text in SEEN.items():
            assert text in d.log(), damage.__name__
        # the good copies are on disk already, while the engine runs
        assert [chain[BAD].read_bytes() for chain in files] == good
        pid = int(re.findall(r"engine process started \(pid (\d+)\)", d.log())[-1])
        os.kill(pid, signal.SIGKILL)  # no shutdown, no save: what is on disk is what was written
        deadline = time.monotonic() + 300
        while "the engine is back" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        healed = [ask(d, p) for p in prompts]
        assert healed == [(t, (PROMPT - 1) // B * B) for t, _ in first]
        assert d.metrics()['hetero_kv_tier_hits_total{tier="disk"}'] == 6 * len(DAMAGE)
    finally:
        assert d.finish() == 0, d.log()


def evict(d, seed: int) -> None:
    """Two prompts of 13 blocks each through a pool of 24: parked blocks go to disk."""
    for s in (seed, seed + 1):
        ask(d, ids(200, s))


def until_logged(d, text: str, seed: int, timeout: float = 4 * RETRY_S) -> None:
    """Keep evicting (each eviction tries a write) until the log says `text`."""
    deadline = time.monotonic() + timeout
    while text not in d.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{d.log()}"
        evict(d, seed)
        seed += 2
        time.sleep(0.5)


def kv_files(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*.kv")}


def test_full_read_only_and_vanished_directories_pause_writes_and_resume(model, tmp_path):
    with tmpfs(tmp_path / "fs", "4m") as fs:
        kv = fs / "kv"
        d = start_daemon(str(model), "--engine-process", "--threads", "1", "--kv-dtype",
                         "fp32", "--num-kv-blocks", "24", "--kv-disk-dir", str(kv),
                         "--kv-disk-gb", "1")  # fmt: skip
        try:
            p1 = ids(PROMPT, 100)
            text, _ = ask(d, p1)
            evict(d, 200)  # p1's blocks are on disk now
            assert len(kv_files(kv)) >= 6

            remount(fs, "ro")
            try:
                until_logged(d, "the directory is read-only", 300)
                assert ask(d, p1) == (text, 96)  # read from the read-only disk
                evict(d, 400)
            finally:
                remount(fs, "rw")
            assert d.log().count("the directory is read-only") == 1
            until_logged(d, "writing to", 500)

            before = kv_files(kv)
            filler = fill(fs)
            until_logged(d, "the disk is full", 600)
            evict(d, 700)
            assert d.log().count("the disk is full") == 1
            filler.unlink()
            until_logged(d, "the disk is full no more", 800)
            assert kv_files(kv) - before  # new files since

            shutil.rmtree(kv)
            until_logged(d, "the directory is gone", 900)
            evict(d, 1000)
            assert d.log().count("the directory is gone") == 1
            assert d.log().count("vanished with its") == 1
            kv.mkdir()
            until_logged(d, "the directory is gone no more", 1100)
            assert kv_files(kv)
            m = d.metrics()
            assert m["hetero_kv_tier_dropped_blocks_total"] > 0  # evictions no tier took
            assert m["hetero_up"] == 1 and m['hetero_kv_blocks_used{tier="cpu"}'] == 0
        finally:
            assert d.finish() == 0, d.log()
