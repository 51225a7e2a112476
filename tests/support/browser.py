"""A real headless Chromium for the status page's tests: the system's browser (Debian's
`chromium` package) driven by Playwright, which downloads no browser of its own here.

`chromium()` gives the browser's path, or skips the test saying what is missing (the CI script
installs it with apt where it runs as root). Screenshots and other files a test keeps go to
$HETERO_TEST_ARTIFACTS (default: a folder under pytest's temporary directory); each one kept is
listed at the end of the run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
KEPT: list[Path] = []  # files kept by this run, listed in the terminal summary


def chromium() -> str:
    """The system Chromium's path (HETERO_CHROMIUM, else the first of CANDIDATES on PATH)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    given = os.environ.get("HETERO_CHROMIUM")
    found = given or next((p for p in map(shutil.which, CANDIDATES) if p), None)
    if not found or not Path(found).exists():
        pytest.skip(
            "no Chromium on this machine: install Debian's `chromium` package "
            "(apt-get install -y chromium) or set HETERO_CHROMIUM to a Chromium binary"
        )
    return found


def artifacts_dir(tmp_path_factory) -> Path:
    given = os.environ.get("HETERO_TEST_ARTIFACTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def keep(path: Path) -> Path:
    KEPT.append(path)
    print(f"artifact: {path}")
    return path
