"""The disk tier's files: round trip, restart scan, cap, and bad files dropped, never loaded."""

from __future__ import annotations

import logging
import os

import pytest

from hetero.kv_tiers.store import HEADER, DiskStore, model_identity
from hetero.synth import write_synthetic

ID_A, ID_B = b"\xaa" * 32, b"\xbb" * 32
N = 1000  # payload bytes


def name(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(N))


def store(root, identity=ID_A, files=8) -> DiskStore:
    return DiskStore(root, identity, N, files * (HEADER.size + N))


def test_round_trip_and_restart_scan(tmp_path):
    s = store(tmp_path)
    for i in range(3):
        assert s.write(name(i), payload(i))
    assert bytes(s.read(name(1))) == payload(1)
    again = store(tmp_path)  # a restarted daemon
    assert sorted(again.names()) == sorted(name(i) for i in range(3))
    assert [bytes(again.read(name(i))) for i in range(3)] == [payload(i) for i in range(3)]
    assert again.read(name(9)) is None


def test_cap_evicts_least_recently_used_files(tmp_path):
    s = store(tmp_path, files=3)
    for i in range(3):
        s.write(name(i), payload(i))
    s.read(name(0))  # 0 is now the most recent: 1 goes first
    s.write(name(3), payload(3))
    assert sorted(s.names()) == sorted([name(0), name(2), name(3)])
    assert len(list(s.dir.glob("*.kv"))) == 3 and s.bytes_used == 3 * (HEADER.size + N)
    with pytest.raises(ValueError, match="kv_disk_gb"):
        DiskStore(tmp_path, ID_A, N, N)


def test_corrupted_file_is_dropped_with_a_warning(tmp_path, caplog):
    s = store(tmp_path)
    s.write(name(1), payload(1))
    path = s.dir / f"{name(1).hex()}.kv"
    data = bytearray(path.read_bytes())
    data[HEADER.size + 10] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        assert s.read(name(1)) is None
    assert "checksum mismatch" in caplog.text and not path.exists() and s.dropped == 1
    assert not s.contains(name(1))


def test_truncated_file_and_leftover_temp_are_dropped_at_scan(tmp_path, caplog):
    s = store(tmp_path)
    s.write(name(1), payload(1))
    s.write(name(2), payload(2))
    path = s.dir / f"{name(1).hex()}.kv"
    os.truncate(path, HEADER.size + N // 2)
    (s.dir / f"{name(5).hex()}.tmp").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        again = store(tmp_path)
    assert again.names() == [name(2)] and "truncated" in caplog.text
    assert not path.exists() and not list(again.dir.glob("*.tmp"))


def test_another_identity_never_reads_these_files(tmp_path, caplog):
    a = store(tmp_path, ID_A)
    a.write(name(1), payload(1))
    b = store(tmp_path, ID_B)
    assert len(b) == 0 and b.dir != a.dir
    # even a file moved into the other identity's directory is refused by its header
    os.replace(a.dir / f"{name(1).hex()}.kv", b.dir / f"{name(1).hex()}.kv")
    b = store(tmp_path, ID_B)
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        assert b.read(name(1)) is None
    assert "does not match" in caplog.text


def test_failed_write_drops_the_block_with_a_warning(tmp_path, caplog):
    s = store(tmp_path)
    s.write(name(1), payload(1))
    for p in s.dir.iterdir():
        p.unlink()
    s.dir.rmdir()
    s.dir.write_bytes(b"not a directory")  # the disk tier's directory is gone: writes fail
    with caplog.at_level(logging.WARNING, logger="hetero.kv_disk"):
        assert s.write(name(2), payload(2)) is False
    assert "cannot write" in caplog.text and not s.contains(name(2))


def test_model_identity_tells_models_and_layouts_apart(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "tiny-qwen3", "q8_0", seed=0, progress=False)
    b = write_synthetic(tmp_path / "b.gguf", "tiny-qwen3", "q8_0", seed=1, progress=False)
    ida = model_identity(a, "kv=fp8|B=16")
    assert ida == model_identity(a, "kv=fp8|B=16")
    assert ida != model_identity(b, "kv=fp8|B=16")  # same shapes and metadata, other weights
    assert ida != model_identity(a, "kv=fp16|B=16")
    assert ida != model_identity(a, "kv=fp8|B=32")
