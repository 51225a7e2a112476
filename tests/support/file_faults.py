"""Real file-system faults for the disk-tier tests: a small tmpfs (a full disk), remounted
read-only; a process without the capabilities that let root ignore file permissions.

Mounting needs root (CAP_SYS_ADMIN); a test that cannot mount is skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# root reads and writes whatever the permission bits say; without these two capabilities it
# obeys them (chmod 000 is unreadable, chmod 555 read-only), as any other user does
DROP_DAC = "cap_dac_override,cap_dac_read_search"


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 256k, 4m) mounted on `path` for the block."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mode: str) -> None:
    """mode "ro" or "rw": the file system at `path` becomes read-only, or writable again."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the file system of `path` with one file, to the last byte but `leave`."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            free = shutil.disk_usage(path).free - leave
            if free <= 0 or os.write(fd, b"\0" * min(free, 1 << 16)) == 0:
                break
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)
    return filler


def without_dac(argv: list[str]) -> list[str]:
    """argv run so that file permissions bind it even as root (capsh drops the capabilities
    from the bounding set before it starts the command); argv itself when not root."""
    if os.geteuid() != 0:
        return argv
    capsh = shutil.which("capsh")
    if capsh is None:
        pytest.skip("running as root without capsh: file permissions cannot bind the daemon")
    return [capsh, f"--drop={DROP_DAC}", "--", "-c", 'exec "$0" "$@"', *argv]
