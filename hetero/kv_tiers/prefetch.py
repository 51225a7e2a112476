"""Read disk-tier blocks ahead of the admission that needs them, on a worker thread.

A request whose prefix hit is (partly) on disk waits at the head of the queue while its files are
read and checked (kv_disk.DiskStore.read: header, CRC), so the engine loop keeps stepping the
running requests instead of stalling on the disk. Once every file is read, admission takes the
verified payloads; a file that failed its check is gone from the disk index by then, so the hit
simply ends before it and the rest is recomputed. Payloads nobody took (the request was aborted)
are dropped oldest first past `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from hetero.kv_tiers.store import DiskStore


class DiskPrefetcher:
    def __init__(self, disk: DiskStore, max_bytes: int = 4 << 30) -> None:
        self.disk = disk
        self.max_ready = max(1, max_bytes // disk.file_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetero-kv-disk")
        self._reading: dict[bytes, Future] = {}
        self._ready: OrderedDict[bytes, memoryview] = OrderedDict()

    def pending(self, names: list[bytes]) -> bool:
        """Start reading those of `names` not read yet; True while any of them is being read."""
        self._collect()
        busy = False
        for h in names:
            if h in self._ready:
                continue
            if h not in self._reading:
                self._reading[h] = self._pool.submit(self.disk.read, h)
            busy = True
        return busy

    def take(self, name: bytes) -> memoryview | None:
        """The verified payload read ahead for `name` (None: not read ahead)."""
        self._collect()
        return self._ready.pop(name, None)

    @property
    def busy(self) -> bool:
        return bool(self._reading)

    def wait(self, timeout: float) -> None:
        """Block until a read finishes (or timeout): the engine has nothing else to do."""
        if self._reading:
            wait(list(self._reading.values()), timeout, return_when=FIRST_COMPLETED)

    def _collect(self) -> None:
        for h, fut in list(self._reading.items()):
            if fut.done():
                del self._reading[h]
                payload = fut.result()
                if payload is not None:
                    self._ready[h] = payload
        while len(self._ready) > self.max_ready:
            self._ready.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
