"""The server tests' report: files they kept (screenshots of the status page) are listed."""

from __future__ import annotations

from tests.support.browser import KEPT


def pytest_terminal_summary(terminalreporter) -> None:
    if KEPT:
        terminalreporter.section("artifacts kept")
        for path in KEPT:
            terminalreporter.write_line(str(path))
