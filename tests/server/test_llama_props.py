"""llama.cpp's tooling endpoints on a real daemon: /props and /slots.

/props says what the model file and the options say, read here independently (the GGUF's own
metadata through the gguf package, the installed version): the context, the chat template, the
slots, the build, and no fill-in-the-middle for SmolLM2, whose /infill indeed refuses (the FIM
model's /props is checked in test_server_infill.py). /slots shows a running stream, its id, its
prompt and its tokens growing, and nothing once it ends.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from importlib.metadata import version

import gguf
import pytest

from tests.support.server_fixture import HOST, start_daemon

SEQS = 8


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(
        "--num-kv-blocks", "128", "--max-num-seqs", str(SEQS), "--max-model-len", "2048",
        "--threads", "1",
    )  # fmt: skip
    yield d
    assert d.finish() == 0, d.log()


def get(daemon, path: str):
    status, _, raw = daemon.request("GET", path)
    assert status == 200, raw
    return json.loads(raw)


def test_props_say_what_the_file_and_the_options_say(daemon, smollm2_path):
    p = get(daemon, "/props")
    reader = gguf.GGUFReader(smollm2_path)
    template = reader.fields["tokenizer.chat_template"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    assert p["chat_template"] == template
    assert (p["bos_token"], p["eos_token"]) == (tokens[bos], tokens[eos])
    assert p["n_ctx"] == p["default_generation_settings"]["n_ctx"] == 2048
    assert p["total_slots"] == SEQS
    assert p["model_path"] == str(smollm2_path)
    assert p["build_info"].startswith(f"hetero {version('hetero')} ")
    assert p["default_generation_settings"]["params"]["n_predict"] == 16  # the API's default
    assert p["fim"] == {"supported": False}
    status, raw = daemon.post("/infill", {"input_prefix": "def f(", "input_suffix": ")"})
    assert status == 400 and raw["error"]["code"] == "fim_not_supported"


def test_slots_show_a_running_stream(daemon):
    assert get(daemon, "/slots") == []
    body = {"messages": [{"role": "user", "content": "Tell me about rivers."}],
            "max_tokens": 64, "stream": True, "ignore_eos": True, "temperature": 0.5}  # fmt: skip
    done = threading.Event()
    usage: dict = {}

    def client() -> None:
        conn = http.client.HTTPConnection(HOST, daemon.port, timeout=300)
        body["stream_options"] = {"include_usage": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"X-Request-Id": "slot-1"})
        raw = conn.getresponse().read()
        conn.close()
        events = [x[6:] for x in raw.decode().split("\n\n") if x.startswith("data: {")]
        usage.update(json.loads(events[-1])["usage"])
        done.set()

    threading.Thread(target=client, daemon=True).start()
    seen = []
    while not done.is_set():
        slots = get(daemon, "/slots")
        if slots and slots[0]["next_token"]["n_decoded"] > 0:
            seen.append(slots)
        time.sleep(0.1)
    assert len(seen) >= 2, "the stream ended before /slots saw it twice"
    for slots in seen:
        (s,) = slots
        assert s["request_id"] == "slot-1" and s["id_task"].startswith("chatcmpl-")
        assert s["n_ctx"] == 2048 and s["is_processing"] and s["started"]
        assert (s["params"]["n_predict"], s["params"]["temperature"]) == (64, 0.5)
        t = s["next_token"]
        assert t["n_decoded"] + t["n_remain"] == 64
        assert s["kv_tokens"] == s["n_prompt_tokens"] + t["n_decoded"]
    decoded = [slots[0]["next_token"]["n_decoded"] for slots in seen]
    assert decoded == sorted(decoded) and decoded[-1] > decoded[0]
    assert seen[0][0]["n_prompt_tokens"] == usage["prompt_tokens"]
    assert get(daemon, "/slots") == []
