"""The daemon's request log and request traces, read back from a real daemon on 127.0.0.1.

Every request gets one info line in the daemon's log, under the id the client sent in
X-Request-Id (echoed) or a new one; its fields are checked against what the client got: the
status, the usage, the finish reason, the times it measured, the error message of a refusal.
With --log-requests every generation request writes one JSON line: the rendered prompt (checked
against transformers' rendering and tokenization), token ids in and out, the logprobs (equal to
the ones the API returns), the sampling parameters, and the engine's phases and steps (a long
prompt in chunks of --max-num-batched-tokens). The trace file rotates at its size limit.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path

import pytest

from hetero.server.request_trace import BACKUPS, MAX_IDS, MAX_TEXT, bound
from tests.support.server_fixture import HOST, sse_events, start_daemon

NAME = "traced"
CHUNK = 64  # --max-num-batched-tokens: a longer prompt is prefilled in chunks of this
MAX_MB = 0.1  # the trace file rotates at 100 kB
ACCESS = re.compile(r" INFO hetero\.access: (\S+) (\S+) (\d+) id=(\S+) (.*)$")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces") / "requests.jsonl"


@pytest.fixture(scope="module")
def daemon(traces):
    d = start_daemon(
        "--served-model-name", NAME, "--num-kv-blocks", "256", "--threads", "1",
        "--speculative", "off", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "16",
        "--log-requests", str(traces), "--log-requests-max-mb", str(MAX_MB),
    )  # fmt: skip
    yield d
    assert d.finish() == 0, d.log()


def access_line(daemon, rid: str, timeout: float = 10.0) -> dict:
    """The access log line of request `rid`, parsed: method, path, status and key=value fields
    (exactly one such line must exist)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [m for m in map(ACCESS.search, daemon.log().splitlines()) if m and m[4] == rid]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(found) == 1, f"{len(found)} access lines for {rid}:\n{daemon.log()[-3000:]}"
    m = found[0]
    rest = m[5]
    fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', rest))
    if "error" in fields:
        fields["error"] = json.loads(fields["error"])
    return {"method": m[1], "path": m[2], "status": int(m[3]), **fields}


def seconds(v: str) -> float:
    assert v.endswith("s"), v
    return float(v[:-1])


def trace_lines(path: Path) -> list[dict]:
    """Every complete trace line, oldest first, over the rotated files (a line the writer's
    thread is still writing, without its newline yet, is left for the next read)."""
    files = [Path(f"{path}.{i}") for i in range(BACKUPS, 0, -1)] + [path]
    texts = [f.read_text() for f in files if f.exists()]
    return [json.loads(x) for t in texts for x in t[: t.rfind("\n") + 1].splitlines()]


def trace_of(path: Path, rid: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # written off the event loop, after the answer
        found = [t for t in trace_lines(path) if t["request_id"] == rid]
        if found:
            assert len(found) == 1
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no trace of {rid}")


def chat(daemon, body: dict, rid: str | None = None):
    headers = {"Content-Type": "application/json"}
    if rid:
        headers["X-Request-Id"] = rid
    t0 = time.perf_counter()
    status, head, raw = daemon.request("POST", "/v1/chat/completions", body, headers)
    return status, head, json.loads(raw), time.perf_counter() - t0


def test_one_line_per_request_with_the_clients_id(daemon):
    body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, head, answer, took = chat(daemon, body, rid="office-42.a")
    assert status == 200 and head["X-Request-Id"] == "office-42.a"
    f = access_line(daemon, "office-42.a")
    usage, choice = answer["usage"], answer["choices"][0]
    assert (f["method"], f["path"], f["status"], f["model"]) == (
        "POST", "/v1/chat/completions", 200, NAME,
    )  # fmt: skip
    assert int(f["prompt"]) == usage["prompt_tokens"]
    assert int(f["cached"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert int(f["output"]) == usage["completion_tokens"] == 12
    assert f["finish"] == choice["finish_reason"] == "length"
    assert f["spec"] == "0/0"  # speculation is off
    assert 0 < seconds(f["ttft"]) < seconds(f["total"]) <= took


def test_an_id_is_made_when_the_client_sends_none_or_an_unusable_one(daemon):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for sent in (None, "has spaces and \u00e9"):
        _, head, _, _ = chat(daemon, body, rid=sent)
        rid = head["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert access_line(daemon, rid)["status"] == 200


def test_a_refusal_logs_the_message_the_client_got(daemon):
    bad = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
    status, head, answer, _ = chat(daemon, bad, rid="too-long")
    assert status == 400 and head["X-Request-Id"] == "too-long"
    f = access_line(daemon, "too-long")
    assert f["status"] == 400 and f["error"] == answer["error"]["message"]
    status, head, raw = daemon.request("GET", "/v1/no/such/path", headers={"X-Request-Id": "nf"})
    assert status == 404 and head["X-Request-Id"] == "nf"
    assert access_line(daemon, "nf")["error"] == json.loads(raw)["error"]["message"]


def test_a_stream_is_logged_once_it_has_ended(daemon):
    body = {
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection(HOST, daemon.port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"X-Request-Id": "st-1"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("X-Request-Id") == "st-1"  # before any token
    raw, arrivals = b"", []
    while chunk := resp.read1(65536):
        arrivals.append(time.perf_counter() - t0)
        raw += chunk
    conn.close()
    usage = sse_events(raw)[-2]["usage"]
    f = access_line(daemon, "st-1")
    assert int(f["output"]) == usage["completion_tokens"] == 16
    assert f["finish"] == "length"
    assert seconds(f["total"]) >= arrivals[-1] - 0.05  # logged after the last event went out
    assert seconds(f["ttft"]) <= arrivals[0]


def test_the_trace_holds_the_prompt_as_rendered_and_the_tokens(daemon, traces, hf_smollm2):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.7, "seed": 5,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    status, _, answer, _ = chat(daemon, body, rid="trace-1")
    assert status == 200
    t = trace_of(traces, "trace-1")
    assert (t["status"], t["model"], t["path"]) == (200, NAME, "/v1/chat/completions")
    (seq,) = t["sequences"]
    want_text = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert seq["prompt_text"] == want_text
    assert seq["prompt_ids"] == hf_smollm2.encode(want_text, add_special_tokens=False)
    assert seq["prompt_tokens"] == len(seq["prompt_ids"]) == answer["usage"]["prompt_tokens"]
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(seq["output_ids"]) == len(seq["output_logprobs"]) == len(content) == 8
    assert seq["output_logprobs"] == [c["logprob"] for c in content]  # the very same numbers
    text = hf_smollm2.decode(seq["output_ids"], skip_special_tokens=True)  # an end token, unshown
    assert text == answer["choices"][0]["message"]["content"]
    assert seq["output_text"] == answer["choices"][0]["message"]["content"]
    p = seq["params"]
    assert (p["temperature"], p["seed"], p["max_tokens"], p["logprobs"]) == (0.7, 5, 8, 2)


def test_the_trace_has_logprobs_the_client_did_not_ask_for(daemon, traces):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    status, _, answer, _ = chat(daemon, body, rid="trace-2")
    assert status == 200 and answer["choices"][0]["logprobs"] is None  # the answer unchanged
    (seq,) = trace_of(traces, "trace-2")["sequences"]
    assert len(seq["output_logprobs"]) == len(seq["output_ids"]) == 6
    assert all(lp <= 0 for lp in seq["output_logprobs"])
    assert seq["params"]["logprobs"] is None  # the client's parameters, as sent


def test_the_trace_times_each_prefill_chunk_and_decode_step(daemon, traces):
    words = "the river runs past the old mill and the bridge " * 20
    body = {"prompt": words, "max_tokens": 5, "temperature": 0}
    status, head, raw = daemon.request("POST", "/v1/completions", body, {"X-Request-Id": "tr-3"})
    assert status == 200
    usage = json.loads(raw)["usage"]
    t = trace_of(traces, "tr-3")
    (seq,) = t["sequences"]
    n = usage["prompt_tokens"]
    assert seq["prompt_tokens"] == n > 2 * CHUNK
    timing, steps = seq["timing"], seq["steps"]
    chunks = -(-n // CHUNK)
    assert [s["kind"] for s in steps] == ["prefill"] * chunks + ["decode"] * 4
    assert [s["tokens"] for s in steps[:chunks]] == [CHUNK] * (chunks - 1) + [
        n - CHUNK * (chunks - 1)
    ]
    assert timing["prefill_chunks"] == chunks and timing["decode_steps"] == 4
    assert timing["prefill_s"] == pytest.approx(sum(s["seconds"] for s in steps[:chunks]))
    assert timing["decode_s"] == pytest.approx(sum(s["seconds"] for s in steps[chunks:]))
    starts = [s["start_s"] for s in steps]
    assert starts == sorted(starts) and starts[0] >= timing["queue_s"]
    for s in steps:
        ((device, secs),) = s["stages"]
        assert device == "cpu" and 0 < secs <= s["seconds"]
    # the engine's phases fit in the time the server measured
    assert timing["prefill_s"] + timing["decode_s"] <= t["total_s"]
    assert t["ttft_s"] >= timing["prefill_s"]


def test_the_trace_file_rotates_at_its_size(daemon, traces):
    # ignore_eos: every answer is max_tokens long, so every line is near the first one's size
    # (a sampled end of text had made them short and eight of them stayed under the limit)
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 48,
            "ignore_eos": True}  # fmt: skip
    limit = MAX_MB * 2**20
    before = traces.stat().st_size
    assert chat(daemon, body, rid="rot-0")[0] == 200
    trace_of(traces, "rot-0")
    after = traces.stat().st_size
    line = after - before if after > before else after  # the file may have rotated just now
    # enough requests to pass the limit once more, not so many that the rotated files drop one
    n = 2 + int((limit - after) // line)
    assert n * line < BACKUPS * limit, (n, line)
    for i in range(1, n):
        assert chat(daemon, body, rid=f"rot-{i}")[0] == 200
    trace_of(traces, f"rot-{n - 1}")
    rotated = Path(f"{traces}.1")
    assert rotated.exists()
    for f in [traces, *(Path(f"{traces}.{i}") for i in range(1, BACKUPS + 1))]:
        if f.exists():  # RotatingFileHandler rotates before a line would pass the limit
            assert f.stat().st_size <= limit
    ids = [t["request_id"] for t in trace_lines(traces)]
    assert [i for i in ids if i.startswith("rot-")] == [f"rot-{i}" for i in range(n)]


def test_long_values_are_bounded_and_named():
    seq = {"prompt_text": "x" * (MAX_TEXT + 10), "output_text": "ok", "prompt_ids": [1, 2],
           "output_ids": list(range(MAX_IDS + 5)), "prompt_tokens": 10**6}  # fmt: skip
    cut: dict[str, int] = {}
    bound(seq, cut, "0.")
    assert seq["prompt_text"] == "x" * MAX_TEXT and seq["output_text"] == "ok"
    assert seq["output_ids"] == list(range(MAX_IDS)) and seq["prompt_ids"] == [1, 2]
    assert seq["prompt_tokens"] == 10**6
    assert cut == {"0.prompt_text": MAX_TEXT + 10, "0.output_ids": MAX_IDS + 5}
