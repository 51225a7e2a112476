"""Whether the disk tier can be written now: a full disk, a read-only or vanished directory pause
its writes; the daemon keeps serving from the tiers it has and tries again later.

    writing --(full: ENOSPC, EDQUOT, EFBIG | read-only: EROFS, EACCES, EPERM | gone: ENOENT)-->
    paused  --(RETRY_S later the next write tries again, and succeeds)--> writing

Each pause is logged once, with its cause, and so is the resumption; writes asked for while
paused are skipped without touching the disk (the block is dropped, or stays in RAM). Any other
error is the one file's (a directory in its place, an I/O error): a warning names the file and
writing goes on.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

log = logging.getLogger("hetero.kv_disk")

RETRY_S = 10.0  # a paused tier tries its next write this long after the failed one
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def cause(err: OSError) -> str | None:
    """Why `err` stops every write to the directory, or None when it is one file's fault."""
    if err.errno in FULL:
        return "the disk is full"
    if err.errno in READ_ONLY:
        return "the directory is read-only"
    if err.errno == errno.ENOENT:
        return "the directory is gone"
    return None


class WriteHealth:
    """The pause state of one directory's writes (used under the store's lock)."""

    def __init__(self, directory: Path, retry_s: float = RETRY_S) -> None:
        self.dir = directory
        self.retry_s = retry_s
        self.paused: str | None = None  # the cause while writes are paused
        self.pauses = 0  # episodes since start (for tests and logs)
        self._retry_at = 0.0

    def may_write(self) -> bool:
        return self.paused is None or time.monotonic() >= self._retry_at

    def failed(self, why: str, err: OSError) -> None:
        """A write failed for a cause that stops them all: pause (logged once per episode)."""
        self._retry_at = time.monotonic() + self.retry_s
        if self.paused == why:
            return
        self.paused = why
        self.pauses += 1
        log.warning(
            "KV disk tier: cannot write to %s: %s (%s); serving from the other tiers, trying "
            "again every %g s",
            self.dir,
            why,
            err.strerror or err,
            self.retry_s,
        )

    def succeeded(self) -> None:
        if self.paused is not None:
            log.info("KV disk tier: writing to %s again (%s no more)", self.dir, self.paused)
            self.paused = None
