"""The daemon's life: 503 while loading, the ready line, the TOML config, a clean stop on SIGTERM
(in-flight requests finish within the grace period or are told why they stop), bad configs and
model files refused with a clear message.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetero.server.app import serve_cli
from hetero.server.config_file import apply_config
from tests.support.server_fixture import free_port, sse_events, start_daemon

NAME = "from-toml"
PACE_MS = 150


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetero.server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "server.toml"
    path.write_text(
        f'served_model_name = "{NAME}"\n'
        "num-kv-blocks = 40  # the command line below overrides this one\n"
        "shutdown_grace = 2.0\n"
        "threads = 1\n"
        'kv_dtype = "fp16"\n'
        f'stream_interval_ms = {PACE_MS}  # a number (or "auto")\n'
        # n-gram guesses from an earlier answer change a later one's batch shapes, and with
        # the CPU's int8 activations that can flip a greedy near-tie: the pacing test compares
        # two runs of one prompt
        'speculative = "off"\n'
    )
    return path


@pytest.fixture(scope="module")
def loading_seen(config):
    """Start the daemon and watch /health from the first moment it listens."""
    d = start_daemon("--config", str(config), "--num-kv-blocks", "48", wait=False)
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and d.proc.poll() is None:
        try:
            status, _, raw = d.request("GET", "/health", timeout=5)
        except OSError:
            time.sleep(0.02)
            continue
        if status == 503 and not seen:
            seen.append((json.loads(raw), d.request("GET", "/metrics")[2].decode()))
            seen.append(d.request("GET", "/v1/models")[0])
        if status == 200:
            break
        time.sleep(0.02)
    yield d, seen
    if d.proc.poll() is None:  # the SIGTERM test did not get to stop it
        d.stop(signal.SIGKILL)


def test_health_is_503_while_loading_then_ready(loading_seen):
    d, seen = loading_seen
    assert d.request("GET", "/health")[0] == 200
    assert seen, "the listener was expected to answer while the model loads"
    (body, metrics_text), models_status = seen
    assert body["error"]["code"] == "loading"
    assert "hetero_up 0" in metrics_text
    assert models_status == 503
    log = d.log()
    ready = [line for line in log.splitlines() if "ready: " in line]
    assert len(ready) == 1
    assert d.url + "/v1" in ready[0] and repr(NAME) in ready[0]
    assert ".gguf" in ready[0] and "KV cache: 48 blocks" in ready[0] and "(fp16)" in ready[0]
    assert "loading layers" in log  # the progress bar


def test_config_file_and_flags(loading_seen):
    d, _ = loading_seen
    status, _, raw = d.request("GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == NAME  # from the file
    assert d.metrics()['hetero_kv_blocks_total{tier="cpu"}'] == 48  # the flag won


def test_paced_stream_groups_tokens_and_loses_none(loading_seen):
    """--stream-interval-ms from the file: a stream's events come at least that far apart, each
    carrying the tokens of its interval; the text is the non-streamed text, the count exact."""
    d, _ = loading_seen
    body = {"model": NAME, "prompt": "The colors of the rainbow are", "max_tokens": 40}
    body |= {"temperature": 0, "ignore_eos": True}
    status, plain = d.post("/v1/completions", body)
    assert status == 200 and plain["usage"]["completion_tokens"] == 40
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    _, raw, arrivals = d.stream("/v1/completions", stream_body)
    events = sse_events(raw)
    texts = [e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    assert "".join(texts) == plain["choices"][0]["text"]
    assert events[-2]["usage"]["completion_tokens"] == 40 and events[-1] == "[DONE]"
    assert 1 < len(texts) < 40  # grouped, and still streamed
    # reads that each got one text event: the gaps between them keep the interval
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) >= len(texts) - 1 and min(gaps[: len(texts) - 2]) >= PACE_MS / 1e3 * 0.8


def test_bench_http_spreads_its_clients_over_processes(loading_seen):
    from hetero.server.bench_http import run_http_bench

    d, _ = loading_seen
    r = run_http_bench(d.url, 4096, 6, 4, 8, 5, seed=3, processes=2, timeout=240)
    assert (r.num_requests, r.concurrency, r.output_tokens) == (6, 4, 30)
    assert len(r.ttft_s) == 6 and all(t > 0 for t in r.ttft_s)  # every request streamed
    assert r.wall_s >= max(r.ttft_s)


def test_sigterm_lets_short_requests_finish_and_tells_the_others_why(loading_seen):
    d, _ = loading_seen
    results: dict[str, tuple] = {}
    first_chunks = threading.Event()

    def stream():
        body = {
            "model": NAME, "prompt": "Once upon a time", "max_tokens": 500, "stream": True,
            "ignore_eos": True,  # sampled: an early end of text would finish within the grace
        }  # fmt: skip
        results["stream"] = d.stream("/v1/completions", body, first_chunks)[:2]

    def post(key, max_tokens):
        body = {
            "model": NAME,
            "prompt": "Hello there",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        results[key] = d.post("/v1/completions", body)

    threads = [threading.Thread(target=stream)]
    threads[0].start()
    assert first_chunks.wait(120)
    threads += [
        threading.Thread(target=post, args=("short", 3)),
        threading.Thread(target=post, args=("long", 500)),
    ]
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)  # both are admitted
    d.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert d.proc.wait(60) == 0
    status, body = results["short"]
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    status, body = results["long"]
    assert status == 503 and "shutting down" in body["error"]["message"]
    status, raw = results["stream"]
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    assert "stopped" in d.log()
    d.log_path.unlink()


@pytest.mark.parametrize(
    "text, message",
    [
        ("nonsense_key = 1\n", "unknown key 'nonsense_key'"),
        ('num_kv_blocks = "8"\n', "wrong type"),
        ('kv_dtype = "fp4"\n', "kv_dtype"),
        ("port = 70000\n", "port"),
        ("threads = [\n", "not valid TOML"),
        ('stream_interval_ms = "soon"\n', "expected 'auto' or milliseconds"),
        ("stream_interval_ms = -5\n", ">= 0"),
    ],
)
def test_bad_config_files_are_refused(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    r = run_cli("--config", str(path), "--port", str(free_port()))
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_example_config_is_valid_and_flags_win():
    example = Path(__file__).parents[2] / "configs" / "server.toml"
    ctx = serve_cli.make_context("hetero-serve", ["--config", str(example), "--port", "9999"])
    values = dict(ctx.params)
    with ctx:
        out = apply_config(ctx, values, values.pop("config_path"))
    assert out["served_model_name"] == "office" and out["max_num_seqs"] == 64
    assert out["port"] == 9999 and out["enable_prefix_caching"] is True


def test_missing_and_broken_model_files(tmp_path):
    r = run_cli(str(tmp_path / "absent.gguf"), "--port", str(free_port()))
    assert r.returncode == 1 and "no such model file" in r.stderr, r.stderr
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all" * 10)
    r = run_cli(str(broken), "--port", str(free_port()))
    assert r.returncode == 1 and "failed to load" in r.stderr, r.stderr
    r = run_cli(str(tmp_path), "--port", str(free_port()))
    assert r.returncode == 1 and "is a directory, not a GGUF model file" in r.stderr, r.stderr


def test_bad_listen_addresses_are_named(smollm2_path):
    r = run_cli(str(smollm2_path), "--host", "", "--port", str(free_port()))
    assert r.returncode == 1 and "--host is empty" in r.stderr, r.stderr
    r = run_cli(str(smollm2_path), "--host", "999.1.1.1", "--port", str(free_port()))
    assert r.returncode == 1 and "cannot listen on '999.1.1.1' port" in r.stderr, r.stderr
    r = run_cli(str(smollm2_path), "--threads", "-5")
    assert r.returncode == 2 and "-5 is not in the range x>=0" in r.stderr, r.stderr
    r = run_cli(str(smollm2_path), "--kv-ram-gb", "nan")  # click's FloatRange lets nan through
    assert r.returncode == 2 and "'nan' is not a finite number" in r.stderr, r.stderr


def test_sigint_while_loading_exits_at_once(smollm2_path):
    d = start_daemon("--threads", "1", wait=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for the listener, not for the model
        try:
            if d.request("GET", "/health", timeout=5)[0] in (200, 503):
                break
        except OSError:
            time.sleep(0.02)
    t0 = time.monotonic()
    assert d.stop(signal.SIGINT) == 0, d.log()
    assert time.monotonic() - t0 < 10
    d.log_path.unlink()


def test_seed_and_long_prefill_threshold_reach_the_engine_config():
    from hetero.factory import LaunchConfig
    from hetero.server.app import SERVER_KEYS

    args = ["--seed", "5", "--long-prefill-token-threshold", "64"]
    ctx = serve_cli.make_context("hetero-serve", args)
    values = {k: v for k, v in ctx.params.items() if k not in (*SERVER_KEYS, "config_path")}
    engine = LaunchConfig.from_options(**values).engine
    assert engine.seed == 5 and engine.scheduler.long_prefill_token_threshold == 64
