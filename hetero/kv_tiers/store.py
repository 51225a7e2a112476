"""The disk tier of the KV cache: one file per named block, kept across restarts.

Layout under the directory the user gives (--kv-disk-dir):

    <dir>/<identity hex, 16 chars>/<block name hex, 64 chars>.kv

A file is a fixed header then the block's bytes exactly as the RAM tier holds them (k, v and, for
fp8, the float32 scales of k and v, each [layers, block_size, kv_heads, (head_dim)]):

    offset 0   8 s   magic b"HETKV\\x00\\x01\\x00"
           8   32 s  model identity (model_identity below)
           40  32 s  block name (prefix_cache.block_hash)
           72  8 Q   payload length
           80  4 I   CRC-32 of the payload
           84  ...   payload

The identity hashes what makes KV bytes mean something: the model file (its size, metadata and
samples of its tensor data), the layers this engine holds, the KV dtype and block size. A
different model, dtype or block size gets another subdirectory and so never reads these files. A
file of the wrong size (truncated by a crash) is dropped when the directory is scanned; one whose
header or checksum does not match is dropped when read; both with a warning, never loaded.
Writes go to a temporary name first and are renamed into place, so a crash leaves no torn file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("hetero.kv_disk")

MAGIC = b"HETKV\x00\x01\x00"
HEADER = struct.Struct("<8s32s32sQI")
_SAMPLE = 1 << 16  # bytes read from each of the model file's sample points


def model_identity(path: str | os.PathLike, layout: str) -> bytes:
    """32 bytes naming (model file, KV layout): its size, first 4 MiB and 16 spread samples.

    The first MiBs hold the GGUF header and metadata (architecture, shapes, vocabulary, and for
    small models tensor data); the samples tell apart files of one shape with other weights
    (random synthetic models). `layout` names the KV form: dtype, block size, layer range.
    """
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(f"{size}|{layout}".encode())
    with open(p, "rb") as f:
        h.update(f.read(4 << 20))
        for i in range(16):
            f.seek(max(0, (size - _SAMPLE) * i // 15))
            h.update(f.read(_SAMPLE))
    return h.digest()


class DiskStore:
    """Files of one (model, KV layout) identity, capped at `cap_bytes`, evicted LRU."""

    def __init__(
        self, root: str | os.PathLike, identity: bytes, payload_bytes: int, cap_bytes: int
    ):
        self.dir = Path(root) / identity.hex()[:16]
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        if cap_bytes < self.file_bytes:
            raise ValueError(
                f"kv_disk_gb: {cap_bytes} bytes cannot hold one KV block file "
                f"({self.file_bytes} bytes)"
            )
        self.cap_files = cap_bytes // self.file_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        # reads may run on a prefetch thread (kv_prefetch.py): the index changes under this lock
        self._lock = threading.RLock()
        self.dropped = 0  # files found bad (truncated, corrupt) and deleted
        self._scan()

    def _path(self, name: bytes) -> Path:
        return self.dir / f"{name.hex()}.kv"

    def _scan(self) -> None:
        """Index the files a previous run left, oldest first; drop truncated ones and leftovers."""
        found = []
        for p in self.dir.iterdir():
            if p.suffix == ".tmp":
                p.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            try:
                name = bytes.fromhex(p.stem)
            except ValueError:
                continue
            if p.suffix != ".kv" or len(name) != 32:
                continue
            st = p.stat()
            if st.st_size != self.file_bytes:
                self._drop(name, f"{st.st_size} bytes, expected {self.file_bytes} (truncated?)")
                continue
            found.append((st.st_mtime_ns, name))
        for _, name in sorted(found):
            self._lru[name] = None
        while len(self._lru) > self.cap_files:
            self._evict()

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_used(self) -> int:
        return len(self._lru) * self.file_bytes

    def contains(self, name: bytes) -> bool:
        return name in self._lru

    def names(self) -> list[bytes]:
        with self._lock:
            return list(self._lru)

    def write(self, name: bytes, payload: bytes | memoryview) -> bool:
        """Store a block (LRU files make room); False, with a warning, if the write fails."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
                return True
            while len(self._lru) >= self.cap_files:
                self._evict()
        header = HEADER.pack(MAGIC, self.identity, name, len(payload), zlib.crc32(payload))
        path, tmp = self._path(name), self._path(name).with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("KV disk tier: cannot write %s (%s); the block is dropped", path, e)
            return False
        with self._lock:
            self._lru[name] = None
        return True

    def read(self, name: bytes) -> bytearray | None:
        """The block's payload, checked against its header and CRC; None (file dropped) if bad."""
        if name not in self._lru:
            return None
        path = self._path(name)
        try:
            with open(path, "rb") as f:  # a bytearray: torch.frombuffer wants writable memory
                data = bytearray(f.read())
        except OSError as e:
            if name in self._lru:  # else evicted meanwhile by a write on another thread
                self._drop(name, f"unreadable ({e})")
            return None
        if len(data) != self.file_bytes:
            self._drop(name, f"{len(data)} bytes, expected {self.file_bytes} (truncated?)")
            return None
        magic, ident, stored_name, n, crc = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size :]
        if (magic, ident, stored_name, n) != (MAGIC, self.identity, name, self.payload_bytes):
            self._drop(name, "header does not match this model, layout or block name")
            return None
        if zlib.crc32(payload) != crc:
            self._drop(name, "checksum mismatch (corrupted)")
            return None
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
        return payload

    def _evict(self) -> None:  # under the lock
        name, _ = self._lru.popitem(last=False)
        self._path(name).unlink(missing_ok=True)

    def _drop(self, name: bytes, why: str) -> None:
        log.warning("KV disk tier: dropping %s: %s", self._path(name), why)
        with self._lock:
            self._lru.pop(name, None)
        self._path(name).unlink(missing_ok=True)
        self.dropped += 1


def default_disk_cap(root: str | os.PathLike) -> int:
    """Half the space free on the directory's file system now."""
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(p).free // 2
