"""The disk tier heals: every kind of bad file is found before its bytes are handed out, dropped
and wanted again; a full, read-only or vanished directory pauses writes (logged once) and they
resume by themselves. The RAM tier's host memory shrinks to what can be had.

The file-system faults are real: a small tmpfs filled to the last byte, the same tmpfs remounted
read-only (tests/support/file_faults.py; skipped where mounting is not allowed), directories
deleted under the store.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pytest
import torch

from hetero.kv_tiers import host_memory
from hetero.kv_tiers.store import HEADER, DiskStore
from tests.support.file_faults import fill, remount, tmpfs

ID_A, ID_B = b"\xaa" * 32, b"\xbb" * 32
N = 1000  # payload bytes
FILE = HEADER.size + N


def name(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(N))


def store(root, identity=ID_A, files=64, retry_s=0.2) -> DiskStore:
    return DiskStore(root, identity, N, files * FILE, retry_s=retry_s)


def path_of(s: DiskStore, i: int):
    return s.dir / f"{name(i).hex()}.kv"


def flip(s, i):
    p = path_of(s, i)
    data = bytearray(p.read_bytes())
    data[HEADER.size + 123] ^= 0x10
    p.write_bytes(bytes(data))


def truncate(s, i):
    os.truncate(path_of(s, i), FILE - 7)


def longer(s, i):
    with open(path_of(s, i), "ab") as f:
        f.write(b"x")


def another_block(s, i):
    shutil.copyfile(path_of(s, i + 1), path_of(s, i))


def another_model(s, i):
    other = store(s.dir.parent, ID_B)
    other.write(name(i), payload(i))
    shutil.copyfile(path_of(other, i), path_of(s, i))


def missing(s, i):
    path_of(s, i).unlink()


def directory(s, i):
    path_of(s, i).unlink()
    path_of(s, i).mkdir()


def fifo(s, i):
    path_of(s, i).unlink()
    os.mkfifo(path_of(s, i))  # a blocking open would hang the reader for good


DAMAGE = [flip, truncate, longer, another_block, another_model, missing, directory, fifo]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_bad_file_is_never_read_and_is_wanted_again(tmp_path, damage, caplog):
    s = store(tmp_path)
    for i in range(3):
        assert s.write(name(i), payload(i))
    damage(s, 1)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(s.read(name(1))), daemon=True)
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        reader.start()
        reader.join(10)
    assert not reader.is_alive(), "the read hung"
    assert got == [None] and "dropping" in caplog.text
    assert not s.contains(name(1)) and s.wants(name(1)) and s.dropped == 1
    assert not path_of(s, 1).exists()  # removed, even a directory or a FIFO in its place
    assert s.write(name(1), payload(1)) and not s.wants(name(1))  # the good copy
    assert bytes(store(tmp_path).read(name(1))) == payload(1)
    assert bytes(s.read(name(0))) == payload(0) and bytes(s.read(name(2))) == payload(2)


def test_unreadable_file_is_dropped(tmp_path, caplog):
    if os.geteuid() == 0:
        pytest.skip("root reads mode-000 files (the daemon test drops that capability)")
    s = store(tmp_path)
    s.write(name(1), payload(1))
    path_of(s, 1).chmod(0)
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        assert s.read(name(1)) is None
    assert "unreadable" in caplog.text and s.wants(name(1))


@pytest.mark.parametrize("damage", [truncate, directory, fifo], ids=lambda f: f.__name__)
def test_the_scan_of_a_restart_drops_what_is_not_a_good_file(tmp_path, damage):
    s = store(tmp_path)
    for i in range(3):
        s.write(name(i), payload(i))
    damage(s, 1)
    dangling = s.dir / f"{name(7).hex()}.kv"
    dangling.symlink_to(tmp_path / "nowhere")
    again = store(tmp_path)
    assert sorted(again.names()) == [name(0), name(2)]
    assert again.wants(name(1)) and again.wants(name(7)) and again.dropped == 2
    assert not path_of(again, 1).exists() and not dangling.is_symlink()


def test_full_disk_pauses_writes_logs_once_and_resumes(tmp_path, caplog):
    with tmpfs(tmp_path / "fs", "256k") as fs:
        s = store(fs, files=10_000)  # the cap is far above what the file system holds
        filler = fill(fs, leave=5 * 4096)  # room for a few files (a page each), then full
        with caplog.at_level(logging.INFO, logger="hetero.kv_disk"):
            results = [s.write(name(i), payload(i)) for i in range(200)]
            first_fail = results.index(False)
            assert not any(results[first_fail:]) and first_fail > 0
            assert caplog.text.count("the disk is full") == 1
            assert s.health.paused == "the disk is full"
            assert len(s) == first_fail and not list(s.dir.glob("*.tmp"))
            assert all(bytes(s.read(name(i))) == payload(i) for i in range(first_fail))
            filler.unlink()  # room again
            time.sleep(0.3)  # the retry time
            assert s.write(name(500), payload(500))
        assert "writing to" in caplog.text and " again" in caplog.text
        assert s.health.paused is None and bytes(s.read(name(500))) == payload(500)


def test_read_only_directory_pauses_writes_and_reads_go_on(tmp_path, caplog):
    with tmpfs(tmp_path / "fs", "1m") as fs:
        s = store(fs)
        s.write(name(1), payload(1))
        remount(fs, "ro")
        try:
            with caplog.at_level(logging.INFO, logger="hetero.kv_disk"):
                assert not any(s.write(name(i), payload(i)) for i in range(2, 20))
                assert caplog.text.count("the directory is read-only") == 1
                assert bytes(s.read(name(1))) == payload(1)  # the tier still serves
        finally:
            remount(fs, "rw")
        time.sleep(0.3)
        assert s.write(name(2), payload(2)) and s.health.paused is None
        # a read-only file system at start: the store opens with writes paused, no error
        sub = fs / "late"
        sub.mkdir()
        remount(fs, "ro")
        try:
            late = store(sub)
            assert late.health.paused == "the directory is read-only" and len(late) == 0
        finally:
            remount(fs, "rw")
        time.sleep(0.3)
        assert late.write(name(3), payload(3)) and bytes(late.read(name(3))) == payload(3)


def test_vanished_directory_is_made_again_or_waited_for(tmp_path, caplog):
    root = tmp_path / "kv"
    s = store(root)
    for i in range(4):
        s.write(name(i), payload(i))
    with caplog.at_level(logging.INFO, logger="hetero.kv_disk"):
        shutil.rmtree(s.dir)  # our subdirectory: made again at the next write
        assert s.read(name(0)) is None and len(s) == 0
        assert caplog.text.count("vanished with its 4 blocks") == 1
        assert "dropping" not in caplog.text  # one line for the loss, not one per file
        assert s.write(name(5), payload(5)) and s.names() == [name(5)]
        shutil.rmtree(root)  # the directory the user gave: waited for, never made by us
        assert not any(s.write(name(i), payload(i)) for i in range(6, 10))
        assert caplog.text.count("the directory is gone") == 1 and not root.exists()
        root.mkdir()
        time.sleep(0.3)
        assert s.write(name(6), payload(6))
    assert "writing to" in caplog.text and bytes(s.read(name(6))) == payload(6)


def test_pinning_that_cannot_be_had_shrinks_or_goes_pageable(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine can pin: the failure is only real without an accelerator")
    with caplog.at_level(logging.WARNING, logger="hetero.kv_tiers"):
        got = host_memory.allocate(4096, 64, pin=True)
    assert got.slots == 64 and not got.pinned and got.buf.numel() == 64 * 4096
    assert "pageable" in caplog.text and "cannot be had" in caplog.text


def test_host_memory_the_system_refuses_shrinks_the_ram_tier(caplog):
    block = 1 << 20
    asked = (1 << 46) // block  # 64 TiB: refused by any machine this runs on
    with caplog.at_level(logging.WARNING, logger="hetero.kv_tiers"):
        got = host_memory.allocate(block, asked, pin=False)
    assert 0 < got.slots < asked and got.buf.numel() == got.slots * block
    assert "cannot be had" in caplog.text
    assert host_memory.allocate(block, 0, pin=False).buf is None
