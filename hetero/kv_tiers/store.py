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
header or checksum does not match (or that cannot be read, or is not a file) is dropped when read;
both with a warning, never loaded, and the block is written again once computed (DiskStore.lost).
Writes go to a temporary name first and are renamed into place, so a crash leaves no torn file;
a full disk or a read-only or vanished directory pauses them (disk_health.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

from hetero.kv_tiers.disk_health import RETRY_S, WriteHealth, cause

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
    """Files of one (model, KV layout) identity, capped at `cap_bytes`, evicted LRU.

    Faults heal: a bad file (truncated, damaged, foreign, unreadable, missing, not a file at all)
    is found before its bytes are handed out, deleted, and its name remembered in `lost`, so the
    block is written again once computed (KVTiers.committed). Writes that cannot be made (a full
    disk, a read-only or vanished directory) pause and resume by themselves (disk_health.py).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        identity: bytes,
        payload_bytes: int,
        cap_bytes: int,
        retry_s: float = RETRY_S,
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
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        # names whose file went bad or missing: a good copy is written when next computed
        self.lost: OrderedDict[bytes, None] = OrderedDict()
        # reads may run on a prefetch thread (kv_prefetch.py): the index changes under this lock
        self._lock = threading.RLock()
        self.health = WriteHealth(self.dir, retry_s)
        self.dropped = 0  # files found bad (truncated, corrupt) and deleted
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only root: no files to read, writes wait until it is not
            self.health.failed(cause(e) or "the directory cannot be made", e)
            return
        self._scan()

    def _path(self, name: bytes) -> Path:
        return self.dir / f"{name.hex()}.kv"

    def _scan(self) -> None:
        """Index the files a previous run left, oldest first; drop truncated ones and leftovers."""
        found = []
        for p in self.dir.iterdir():
            if p.suffix == ".tmp":
                _remove(p)  # a write that a crash interrupted
                continue
            try:
                name = bytes.fromhex(p.stem)
            except ValueError:
                continue
            if p.suffix != ".kv" or len(name) != 32:
                continue
            try:
                st = p.stat()
            except OSError as e:  # a dangling link, a file gone meanwhile
                self._drop(name, f"unreadable ({e.strerror or e})")
                continue
            if not stat.S_ISREG(st.st_mode):
                self._drop(name, "not a regular file")
            elif st.st_size != self.file_bytes:
                self._drop(name, f"{st.st_size} bytes, expected {self.file_bytes} (truncated?)")
            else:
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

    def wants(self, name: bytes) -> bool:
        """True when `name`'s file was lost and a good copy should be written."""
        return name in self.lost

    def want(self, names: list[bytes]) -> None:
        """Remember names to write again when computed (the newest cap_files of them)."""
        with self._lock:
            for h in names:
                self.lost[h] = None
                self.lost.move_to_end(h)
            while len(self.lost) > self.cap_files:
                self.lost.popitem(last=False)

    # -- writing -------------------------------------------------------------------------------

    def write(self, name: bytes, payload: bytes | memoryview) -> bool:
        """Store a block (LRU files make room); False when it cannot be written now."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
                self.lost.pop(name, None)
                return True
            if not self.health.may_write():  # paused: skipped without touching the disk
                return False
            while len(self._lru) >= self.cap_files:
                self._evict()
        header = HEADER.pack(MAGIC, self.identity, name, len(payload), zlib.crc32(payload))
        try:
            self._put(self._path(name), header, payload)
        except OSError as e:
            self._write_failed(name, e)
            return False
        with self._lock:
            self._lru[name] = None
            self.lost.pop(name, None)
            self.health.succeeded()
        return True

    def _put(self, path: Path, header: bytes, payload) -> None:
        """Write to a temporary name, then rename into place (a crash leaves no torn file). The
        directory is made again if it vanished while the root the user gave is still there."""
        tmp = path.with_suffix(".tmp")
        if not self.dir.is_dir() and self.dir.parent.is_dir():
            self._vanished()
            self.dir.mkdir(exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            _remove(tmp)
            raise

    def _write_failed(self, name: bytes, e: OSError) -> None:
        why = cause(e)
        if why is None:  # this file's own trouble (a directory in its place, an I/O error)
            log.warning("KV disk tier: cannot write %s (%s); the block is dropped", name.hex(), e)
            return
        if not self.dir.is_dir():
            self._vanished()
        with self._lock:
            self.health.failed(why, e)

    # -- reading -------------------------------------------------------------------------------

    def read(self, name: bytes) -> bytearray | None:
        """The block's payload, checked against its header and CRC; None (file dropped) if bad."""
        if name not in self._lru:
            return None
        try:
            data = self._read_file(self._path(name))
        except OSError as e:
            if not self.dir.is_dir():
                self._vanished()
            elif name in self._lru:  # else evicted meanwhile by a write on another thread
                self._drop(name, f"unreadable ({e.strerror or e})")
            return None
        if data is None:
            self._drop(name, "not a regular file")
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

    def _read_file(self, path: Path) -> bytearray | None:
        """The file's bytes (one more than a good file has, to see a longer one), or None when it
        is not a regular file. Non-blocking open: a FIFO put in its place never hangs a read."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return bytearray(f.read(self.file_bytes + 1))  # writable: torch.frombuffer wants it

    # -- dropping ------------------------------------------------------------------------------

    def _evict(self) -> None:  # under the lock
        name, _ = self._lru.popitem(last=False)
        _remove(self._path(name))

    def _drop(self, name: bytes, why: str) -> None:
        log.warning("KV disk tier: dropping %s: %s", self._path(name), why)
        with self._lock:
            self._lru.pop(name, None)
            self.want([name])
        _remove(self._path(name))
        self.dropped += 1

    def _vanished(self) -> None:
        """The directory is gone: so is every file the index lists (logged once per loss)."""
        with self._lock:
            n = len(self._lru)
            self._lru.clear()
        if n:
            log.warning("KV disk tier: %s vanished with its %d blocks", self.dir, n)


def _remove(path: Path) -> None:
    """Delete a file, or an empty directory in a file's place; a failure (a read-only directory)
    leaves it, to be found bad again."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        with contextlib.suppress(OSError):
            path.rmdir()
    except OSError:
        pass


def default_disk_cap(root: str | os.PathLike) -> int:
    """Half the space free on the directory's file system now."""
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(p).free // 2
