"""The real `hetero-serve` daemon as a subprocess on 127.0.0.1, for the server tests.

One daemon per test module (module-scoped fixtures call `start_daemon`); its log goes to a file
the tests can read. Raw HTTP goes through `http.client`, so tests control every byte sent.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero.server.metrics import parse_metrics

HOST = "127.0.0.1"
LOAD_TIMEOUT_S = 300.0  # the model loads in seconds, but this machine is shared and busy
# HETERO_TEST_ENGINE_PROCESS=1 (or 0) runs every test daemon with the engine in its own process
# (or on a thread); unset, each daemon takes the default (a process).
ENGINE_MODE = {"1": ("--engine-process",), "0": ("--no-engine-process",)}.get(
    os.environ.get("HETERO_TEST_ENGINE_PROCESS", ""), ()
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | list | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> tuple[int, dict[str, str], bytes]:
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def stream(
        self, path: str, body: Any, first: threading.Event | None = None, timeout: float = 120.0
    ) -> tuple[int, bytes, list[float]]:
        """POST body and read the answer as it arrives: (status, the bytes, the perf_counter
        time of each read). `first` is set once the first bytes are in (or the answer ended)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body))
            resp = conn.getresponse()
            raw, arrivals = b"", []
            while chunk := resp.read1(65536):
                arrivals.append(time.perf_counter())
                raw += chunk
                if first is not None:
                    first.set()
            return resp.status, raw, arrivals
        finally:
            if first is not None:
                first.set()
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, _, raw = self.request("GET", "/metrics")
        assert status == 200
        return parse_metrics(raw.decode())

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"the daemon was not ready within {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def finish(self) -> int:
        """Stop it; its log is removed after a clean exit (kept for a failure's message)."""
        code = self.stop()
        if code == 0:
            self.log_path.unlink(missing_ok=True)
        return code


def start_daemon(
    *args: str, wait: bool = True, port: int | None = None, wrap: Callable | None = None
) -> Daemon:
    """`python -m hetero.server ARGS --host 127.0.0.1 --port FREE`, ready when `wait`; `wrap`
    turns that command line into the one started (file_faults.without_dac)."""
    port = port or free_port()
    log_path = Path(tempfile.mkstemp(prefix="hetero-serve-", suffix=".log")[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    mode = () if {"--engine-process", "--no-engine-process"} & set(args) else ENGINE_MODE
    cmd = [sys.executable, "-m", "hetero.server", *args, *mode, "--host", HOST, "--port", str(port)]
    with open(log_path, "wb") as log:
        cmd = cmd if wrap is None else wrap(cmd)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    daemon = Daemon(proc, port, log_path)
    if wait:
        try:
            daemon.wait_ready()
        except BaseException:
            daemon.stop(signal.SIGKILL)
            raise
    return daemon


def daemon_pair(first: tuple[str, ...], second: tuple[str, ...]):
    """A module fixture's body for two daemons compared side by side: both started (the first
    stopped if the second fails to start), yielded, then each asked to exit cleanly."""
    one = start_daemon(*first)
    try:
        two = start_daemon(*second)
    except BaseException:
        one.finish()
        raise
    yield one, two
    assert one.finish() == 0, one.log()
    assert two.finish() == 0, two.log()


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an event stream (JSON decoded; "[DONE]" kept as a string)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# A greedy run may take the other of two near-tied tokens when a batch's composition changes the
# arithmetic slightly (fp8 KV rounding amplifies differences of one ulp): within this logprob gap.
NEAR_TIE = 0.05


def same_greedy_tokens(got: list[str], want: list[str], want_tops: list[dict[str, float]]) -> bool:
    """got == want, or they part where want's top two tokens were a near tie and got took the
    runner-up (what follows a different token is not compared)."""
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top = want_tops[k]
            return g in top and w in top and abs(top[w] - top[g]) < NEAR_TIE
    return True
