"""A pipeline's start, phase by phase: what each stage is doing, and a bound on every wait.

Every stage started beside the engine has a status pipe to it. Through it the stage reports
each phase of its start as it enters it (joining the process group, loading its layers, loaded,
waiting for the other stages, KV sized, ready) and, if it fails, why. The engine logs each
phase with the time since the start, and a start that takes longer than stage_timeout fails
with the stage, and the phase it is stuck in, named: a stage that hangs (on a GPU, a lock, a
port, memory) is never silent.

    stage -> engine   ("phase", text, seconds since the stage process began)
                      ("error", text)
"""

from __future__ import annotations

import logging
import sys
import time
from multiprocessing.connection import wait

log = logging.getLogger("hetero.pipeline")


class StageStatus:
    """The stage's side: reports phases to the engine, or (a stage started by hand on another
    host, without a pipe to it) to its own stderr, timestamped."""

    def __init__(self, rank: int, conn=None):
        self.rank, self.conn, self.t0 = rank, conn, time.monotonic()

    def phase(self, text: str) -> None:
        took = time.monotonic() - self.t0
        if self.conn is None:  # no engine beside it to log the phase: say it here
            stamp = time.strftime("%H:%M:%S")
            print(
                f"[{stamp}] stage {self.rank}: {text} (+{took:.1f} s)", file=sys.stderr, flush=True
            )
        self._send(("phase", text, took))

    def error(self, text: str) -> None:
        self._send(("error", text))

    def _send(self, message: tuple) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(message)
        except OSError:  # the engine is gone: nothing left to tell
            pass


class StartWatch:
    """The engine's side: every local stage's last phase and error, read from its pipe."""

    def __init__(self, ranks: list[int], pipes: list, names: list[str]):
        self.ranks, self.pipes, self.names = ranks, pipes, names
        self.phases = {r: "spawning the process" for r in ranks}
        self.errors: list[str] = []
        self.closed: set[int] = set()  # ranks whose pipe reached its end (the stage exited)
        self.t0 = time.monotonic()

    def drain(self, ready=None) -> None:
        """Read every message waiting on the status pipes (those in `ready`, or all)."""
        for rank, pipe in zip(self.ranks, self.pipes):
            if ready is not None and pipe not in ready:
                continue
            while rank not in self.closed and _poll(pipe):
                try:
                    msg = pipe.recv()
                except (EOFError, OSError):
                    self.closed.add(rank)
                    break
                self._note(rank, msg)

    def _note(self, rank: int, msg) -> None:
        if msg[0] == "error":
            self.errors.append(msg[1])
            return
        self.phases[rank] = msg[1]
        log.info(
            "pipeline start +%.1f s: stage %d (%s): %s",
            time.monotonic() - self.t0,
            rank,
            self.names[rank],
            msg[1],
        )

    def stuck(self) -> str:
        """Where each stage is, for an error message."""
        return "; ".join(f"stage {r} ({self.names[r]}) at '{p}'" for r, p in self.phases.items())

    def wait_ready(self, conn, sentinels: list, timeout: float) -> tuple[str | None, float]:
        """Wait for stage 0's first message on `conn`, reporting phases as they come.

        Returns ("ready", elapsed) once conn has data, ("died", elapsed) when a process ends,
        ("timeout", elapsed) when `timeout` seconds pass first."""
        deadline = self.t0 + timeout
        while True:
            live = [p for r, p in zip(self.ranks, self.pipes) if r not in self.closed]
            left = deadline - time.monotonic()
            if left <= 0:
                self.drain()
                return "timeout", time.monotonic() - self.t0
            ready = wait([conn, *live, *sentinels], timeout=left)
            self.drain(ready)
            if conn in ready:
                return "ready", time.monotonic() - self.t0
            if any(s in ready for s in sentinels):
                self.drain()
                return "died", time.monotonic() - self.t0


def _poll(pipe) -> bool:
    """True when a message (or the pipe's end) waits to be read."""
    try:
        return pipe.poll()
    except (EOFError, OSError):
        return True
