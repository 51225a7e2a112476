"""The real daemon brings its engine back: an engine process killed mid-stream (or a pipeline
stage that died for good) ends the requests in flight with the reason, /health says
"restarting", a new engine serves again and /metrics counts it; the disk tier's blocks written
before the crash are hits for the new engine. Restarts are bounded: past --engine-restarts deaths
within the window (a restart that cannot load counts as one) the daemon exits with the reason.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from hetero.synth import write_synthetic
from tests.support.server_fixture import sse_events, start_daemon

BLOCK = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return write_synthetic(
        tmp_path_factory.mktemp("restart") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def engine_pid(d) -> int:
    return int(re.findall(r"engine process started \(pid (\d+)\)", d.log())[-1])


def cut_stream(d, kill) -> list:
    """Start a long stream, call kill() once its first bytes are in; the stream's events."""
    out: dict = {}
    started = threading.Event()
    body = {"prompt": ids(5, 99), "max_tokens": 300, "ignore_eos": True, "stream": True}
    t = threading.Thread(
        target=lambda: out.update(r=d.stream("/v1/completions", body, started, timeout=120))
    )
    t.start()
    assert started.wait(120)
    kill()
    t.join(60)
    assert not t.is_alive(), "the request was left hanging"
    status, raw, _ = out["r"]
    assert status == 200
    return sse_events(raw)


def watch_restart(d, timeout: float = 300) -> list[dict]:
    """/health's 503 bodies from the first (the death is seen) until it answers 200 again."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, raw = d.request("GET", "/health", timeout=10)
        if status == 200 and seen:
            return seen
        if status == 200:  # the daemon has not read the engine's end yet
            time.sleep(0.01)
            continue
        seen.append(json.loads(raw))
        time.sleep(0.05)
    raise TimeoutError(d.log())


def complete(d, prompt: list[int]) -> dict:
    status, body = d.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body


def test_a_killed_engine_comes_back_and_reuses_the_disk_tier(model_path, tmp_path):
    kv = tmp_path / "kv"
    d = start_daemon(str(model_path), "--engine-process", "--threads", "1", "--num-kv-blocks",
                     "24", "--kv-dtype", "fp32", "--kv-disk-dir", str(kv))  # fmt: skip
    try:
        p1 = ids(100, 1)
        first = complete(d, p1)
        for seed in (2, 3):  # 300-token prompts push all of p1's parked blocks to disk
            complete(d, ids(300, seed))
        assert len(list(kv.rglob("*.kv"))) >= (len(p1) - 1) // BLOCK
        pid = engine_pid(d)
        events = cut_stream(d, lambda: os.kill(pid, signal.SIGKILL))
        assert events[-1] == "[DONE]"
        message = events[-2]["error"]["message"]
        assert "the engine process died (killed by SIGKILL)" in message, message
        seen = watch_restart(d)
        assert seen and seen[0]["error"]["code"] == "restarting", seen
        assert "killed by SIGKILL" in seen[0]["error"]["message"]
        assert engine_pid(d) != pid
        again = complete(d, p1)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        m = d.metrics()
        assert m["hetero_engine_process_restarts_total"] == 1 and m["hetero_up"] == 1
        assert m['hetero_kv_tier_hits_total{tier="disk"}'] == 6  # the new engine's counters
    finally:
        assert d.finish() == 0, d.log()


def test_restarts_are_bounded_and_a_failed_load_counts(model_path, tmp_path):
    model = shutil.copyfile(model_path, tmp_path / "m.gguf")
    d = start_daemon(str(model), "--engine-process", "--threads", "1", "--num-kv-blocks", "40",
                     "--engine-restarts", "2")  # fmt: skip
    try:
        os.kill(engine_pid(d), signal.SIGKILL)
        watch_restart(d)
        complete(d, ids(20, 5))
        model.unlink()  # the next engine cannot load
        os.kill(engine_pid(d), signal.SIGKILL)
        code = d.proc.wait(120)
    finally:
        d.stop(signal.SIGKILL)
    log = d.log()
    assert code == 1
    assert "restarting the engine in 1.0 s" in log and "restarting the engine in 2.0 s" in log
    assert "the engine failed to start again" in log
    assert "the engine died 3 times within 600 s, more than the 2 restarts allowed" in log
    assert "the server stops: the engine failed to start again" in log
    d.log_path.unlink()


def test_a_pipeline_stage_that_died_for_good_gets_a_new_engine(model_path):
    """Two CPU stages, the engine on the server's thread; --max-restarts 0: the pipeline gives up
    at once, so the engine dies and the daemon starts a new one (new stages)."""
    d = start_daemon(str(model_path), "--no-engine-process", "--devices", "cpu,cpu",
                     "--max-restarts", "0", "--threads", "1", "--kv-dtype", "fp32",
                     "--num-kv-blocks", "40")  # fmt: skip
    try:
        before = complete(d, ids(30, 7))
        stage = stages(d)[-1]
        events = cut_stream(d, lambda: os.kill(stage, signal.SIGKILL))
        message = events[-2]["error"]["message"]
        assert "killed by SIGKILL" in message, message
        seen = watch_restart(d)
        assert seen and seen[0]["error"]["code"] == "restarting", seen
        assert "giving up after 0 restarts" in seen[0]["error"]["message"]
        assert stage not in stages(d)
        assert complete(d, ids(30, 7))["choices"] == before["choices"]
        assert d.metrics()["hetero_engine_process_restarts_total"] == 1
    finally:
        assert d.finish() == 0, d.log()


def stages(d) -> list[int]:
    """The pids of the daemon's stage processes (its spawned children, not the tracker)."""
    kids = psutil.Process(d.proc.pid).children()
    return [k.pid for k in kids if "spawn_main" in " ".join(k.cmdline()) and k.is_running()]
