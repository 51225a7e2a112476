"""The engine in its own process (frontdoor/process.py, frontdoor/client.py), on a tiny synthetic
model: streams equal the offline engine's tokens, a refused request raises in its caller, an
abort frees the KV blocks before the next gauge read, closing ends what is in flight with the
reason, and a killed engine process fails its requests and, with restarts off, stops the real
daemon with a clear message.

The other server tests run in this mode too: HETERO_TEST_ENGINE_PROCESS=1
(tests/support/server_fixture.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from hetero.config import RuntimeConfig
from hetero.engine.config import EngineConfig
from hetero.factory import LaunchConfig
from hetero.frontdoor.client import EngineProcess
from hetero.llm import LLM
from hetero.sampling import SamplingParams
from hetero.server.app import serve_cli
from hetero.server.config_file import apply_config
from hetero.server.metrics import engine_lines, parse_metrics
from hetero.server.state import ServerSettings
from hetero.synth import write_synthetic
from hetero.tokenizer import Tokenizer
from tests.support.server_fixture import sse_events, start_daemon

PROMPTS = [[5 + i, 40 + 3 * i, 77, 9 + i] for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
LAUNCH = LaunchConfig(EngineConfig(num_kv_blocks=64), RuntimeConfig(threads=1))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return write_synthetic(
        tmp_path_factory.mktemp("ep") / "m.gguf", "tiny-llama", "q8_0", progress=False
    )


def offline(path) -> list[list[int]]:
    """Each prompt's tokens from the offline engine."""
    return [
        o.outputs[0].token_ids
        for o in LLM(str(path), num_kv_blocks=64, threads=1).generate(PROMPTS, PARAMS)
    ]


def gauges(g) -> dict[str, float]:
    return parse_metrics("\n".join(engine_lines(g)))


async def exercise(path: Path) -> dict:
    deaths: list[str] = []
    ep = EngineProcess(path, LAUNCH, Tokenizer.from_gguf(path), deaths.append)
    await asyncio.wait_for(ep.start(), 300)
    got: dict = {"info": ep.info, "deaths": deaths}
    try:

        async def one(i: int) -> list:
            return [o async for o in ep.generate(f"r{i}", PROMPTS[i], PARAMS)]

        got["streams"] = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        with pytest.raises(ValueError, match="token ids must be in"):
            async for _ in ep.generate("bad", [1, 10**7], PARAMS):
                pass
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async with aclosing(ep.generate("left", PROMPTS[0], long)) as steps:
            await anext(steps)  # admitted, holding blocks; then the caller goes away
            got["held"] = gauges(await ep.gauges())['hetero_kv_blocks_used{tier="cpu"}']
        got["after_abort"] = gauges(await ep.gauges())
        got["closed"] = await close_while_streaming(ep, long)
    finally:
        await asyncio.to_thread(ep.close, 30.0)
    got["exitcode"] = ep.proc.exitcode
    return got


async def close_while_streaming(ep: EngineProcess, params: SamplingParams) -> list:
    outs = []
    async for out in ep.generate("cut", PROMPTS[1], params):
        outs.append(out)
        if len(outs) == 2:
            threading.Thread(target=ep.close, args=(30.0,)).start()
    return outs


def test_engine_process_serves_like_the_offline_engine(model_path):
    want = offline(model_path)
    got = asyncio.run(exercise(model_path))
    assert got["info"].num_blocks == 64 and got["info"].max_model_len > 0
    for outs, tokens in zip(got["streams"], want):
        assert [t for o in outs for t in o.new_token_ids] == tokens
        assert [lp.token_id for o in outs for lp in o.logprobs] == tokens
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[0].num_prompt_tokens == 4
    assert got["held"] > 0
    m = got["after_abort"]
    assert m['hetero_kv_blocks_used{tier="cpu"}'] == 0  # the abort came before the read
    assert m["hetero_num_requests_running"] == m["hetero_num_requests_waiting"] == 0
    assert m["hetero_engine_steps_total"] > 12
    # each request's prompt ran in a step of its own or beside decodes: the rest decoded only
    assert 0 < m["hetero_engine_decode_steps_total"] < m["hetero_engine_steps_total"]
    assert 0 < m["hetero_engine_decode_seconds_total"] < m["hetero_engine_busy_seconds_total"]
    assert m["hetero_engine_graph_steps_total"] == 0  # a CPU engine: every step eager
    last = got["closed"][-1]
    assert last.finished and last.error == "the server is shutting down"
    assert got["exitcode"] == 0 and got["deaths"] == []  # asked to stop: not a death


def test_engine_process_is_the_default():
    assert ServerSettings(Path("m.gguf")).engine_process
    ctx = serve_cli.make_context("hetero-serve", [])
    assert ctx.params["engine_process"] is True
    ctx = serve_cli.make_context("hetero-serve", ["--no-engine-process"])
    assert ctx.params["engine_process"] is False


def test_engine_process_option_in_the_config_file(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("engine_process = true\n")
    ctx = serve_cli.make_context("hetero-serve", ["--config", str(path)])
    values = dict(ctx.params)
    with ctx:
        assert apply_config(ctx, values, values.pop("config_path"))["engine_process"] is True
    ctx = serve_cli.make_context("hetero-serve", ["--config", str(path), "--no-engine-process"])
    values = dict(ctx.params)
    with ctx:
        assert apply_config(ctx, values, values.pop("config_path"))["engine_process"] is False


def stream_until_cut(d, out: dict, started: threading.Event) -> None:
    body = {"prompt": "once", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    out["stream"] = d.stream("/v1/completions", body, started, timeout=60)[:2]


def post_until_cut(d, out: dict) -> None:
    body = {"prompt": "twice", "max_tokens": 1000, "ignore_eos": True}
    out["post"] = d.post("/v1/completions", body, timeout=60)


def test_a_killed_engine_process_fails_requests_and_stops_the_daemon(model_path):
    """With --engine-restarts 0 (test_engine_restart.py: the default starts it again)."""
    d = start_daemon(str(model_path), "--engine-process", "--threads", "1", "--num-kv-blocks", "80",
                     "--engine-restarts", "0")  # fmt: skip
    try:
        pid = int(re.search(r"engine process started \(pid (\d+)\)", d.log()).group(1))
        out: dict = {}
        started = threading.Event()
        threads = [
            threading.Thread(target=stream_until_cut, args=(d, out, started)),
            threading.Thread(target=post_until_cut, args=(d, out)),
        ]
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)  # the other request is admitted too
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request was left hanging"
        t0 = time.monotonic()
        code = d.proc.wait(30)
        assert time.monotonic() - t0 < 30
    finally:
        d.stop(signal.SIGKILL)
    status, raw = out["stream"]
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    message = events[-2]["error"]["message"]
    assert "the engine process died (killed by SIGKILL)" in message, message
    status, body = out["post"]
    assert status == 503 and "the engine process died" in body["error"]["message"], body
    assert code == 1
    assert "the server stops: the engine process died (killed by SIGKILL)" in d.log()
    assert "more than the 0 restarts allowed" in d.log()
    d.log_path.unlink()
