"""How a child process ended, in words for an error message."""

from __future__ import annotations

import signal


def exit_reason(code: int | None) -> str:
    """multiprocessing's exitcode -> "exit code 3", "killed by SIGKILL" or "still running"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
