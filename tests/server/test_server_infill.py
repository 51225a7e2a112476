"""Fill-in-the-middle: `/infill` (llama.cpp's API) and `suffix` on /v1/completions.

SmolLM2 has no FIM tokens, so the module writes a copy of it (the real `gguf` writer, every
tensor and key kept) whose vocabulary has them: three unused tokens renamed to `<fim_prefix>`,
`<fim_middle>` and `<fim_suffix>` (found by their text, as llama.cpp finds them) and
`<file_sep>` named the file separator by metadata key. `<reponame>` is already the repo token.
The weights were not trained for FIM, so tests check the prompt the server builds, token for
token, and that its greedy output equals that of the same ids sent as a plain prompt.
"""

from __future__ import annotations

import json
import time

import gguf
import pytest

from hetero.server.infill import InfillInput, LineLimits, build_infill, indent_cut
from hetero.tokenizer import Tokenizer
from tests.support.server_fixture import sse_events, start_daemon

RENAMED = {11: "<fim_prefix>", 12: "<fim_middle>", 13: "<fim_suffix>"}
FILE_SEP = 5  # <file_sep>
CONTEXT = 256
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "utils.py", "text": "def sub(a, b):\n    return a - b\n"}]


def write_fim_model(src, dst) -> None:
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = [RENAMED.get(i, t) for i, t in enumerate(value)]
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    writer.add_uint32(gguf.Keys.Tokenizer.FIM_SEP_ID, FILE_SEP)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


@pytest.fixture(scope="module")
def fim_model(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    write_fim_model(smollm2_path, path)
    return path


@pytest.fixture(scope="module")
def tok(fim_model):
    return Tokenizer.from_gguf(fim_model)


@pytest.fixture(scope="module")
def daemon(fim_model):
    d = start_daemon(
        str(fim_model), "--max-model-len", str(CONTEXT), "--num-kv-blocks", "64", "--threads", "1"
    )
    yield d
    assert d.finish() == 0, d.log()


def expected_ids(tok, prefix=PREFIX, suffix=SUFFIX, prompt="", extra=EXTRA) -> list[int]:
    """llama.cpp's repo-level layout, spelled out independently of the server's code."""
    ids = [tok.fim.repo, *tok.encode("myproject\n")]
    for chunk in extra:
        ids += [FILE_SEP, *tok.encode(chunk["filename"] + "\n"), *tok.encode(chunk["text"])]
    ids += [FILE_SEP, *tok.encode("filename\n"), 11, *tok.encode(prefix), *tok.encode(prompt)]
    return ids + [13, *tok.encode(suffix), 12]


def greedy_text(daemon, ids: list[int], n: int) -> str:
    status, body = daemon.post(
        "/v1/completions", {"prompt": ids, "max_tokens": n, "temperature": 0}
    )
    assert status == 200, body
    return body["choices"][0]["text"]


def test_the_vocabulary_has_fim_tokens(tok):
    f = tok.fim
    assert (f.prefix, f.middle, f.suffix, f.sep, f.repo) == (11, 12, 13, FILE_SEP, 4)


def test_infill_prompt_layout(tok):
    inp = InfillInput(PREFIX, SUFFIX, "ret", [(c["filename"], c["text"]) for c in EXTRA])
    ids, truncated = build_infill(tok, inp, 10_000)
    assert ids == expected_ids(tok, prompt="ret") and not truncated


def test_control_token_text_in_user_code_stays_text(tok):
    """A file that mentions "<fim_middle>" (a tokenizer's source, say) must not put the control
    token in the prompt: the user's texts are encoded with special-token parsing off."""
    code = "s = '<fim_middle>'\n"
    inp = InfillInput(code, "t = '<fim_suffix>'", "", [("a<fim_prefix>.py", "<fim_middle>")])
    ids, _ = build_infill(tok, inp, 10_000)
    assert [ids.count(t) for t in (11, 12, 13)] == [1, 1, 1]
    assert tok.decode(ids[ids.index(11) + 1 : ids.index(13)]) == code


def test_long_inputs_are_cut_away_from_the_cursor(tok):
    prefix, suffix = "x = 1\n" * 300, "y = 2\n" * 300
    inp = InfillInput(prefix, suffix, "", [("big.py", "z = 3\n" * 300)])
    ids, truncated = build_infill(tok, inp, 200)
    assert truncated and len(ids) == 200
    pre, suf = ids.index(11), ids.index(13)
    assert ids[pre + 1 : suf] == tok.encode(prefix)[-(suf - pre - 1) :]  # the prefix's end
    assert ids[suf + 1 : -1] == tok.encode(suffix)[: len(ids) - suf - 2]  # the suffix's start
    assert len(ids) - suf - 2 == (200 - 3) // 4  # the suffix keeps a quarter


def test_infill_endpoint_builds_the_prompt_and_generates_from_it(daemon, tok):
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": EXTRA,
        "n_predict": 8,
        "temperature": 0,
        "cache_prompt": True,  # llama.cpp's knob: accepted, the prefix cache is always on
        "samplers": ["top_k", "top_p", "infill"],
    }
    status, out = daemon.post("/infill", body)
    assert status == 200, out
    ids = expected_ids(tok)
    assert out["tokens_evaluated"] == len(ids)
    assert out["stop"] is True and out["truncated"] is False
    assert out["stop_type"] in ("eos", "limit")
    assert out["stop_type"] == "eos" or out["tokens_predicted"] == 8
    assert out["content"] == greedy_text(daemon, ids, 8)
    status, _, raw = daemon.request("POST", "/infill", {**body, "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == out["content"]
    assert events[-1]["tokens_evaluated"] == len(ids)


def test_completions_suffix_is_fill_in_the_middle(daemon, tok):
    ids = [11, *tok.encode(PREFIX), 13, *tok.encode(SUFFIX), 12]
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 6, "temperature": 0}
    status, out = daemon.post("/v1/completions", body)
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["text"] == greedy_text(daemon, ids, 6)


def test_n_predict_0_only_warms_the_cache(daemon, tok):
    body = {"input_prefix": "class Warm:\n    ", "input_suffix": SUFFIX, "input_extra": EXTRA}
    status, out = daemon.post("/infill", {**body, "n_predict": 0})
    assert status == 200 and out["content"] == ""
    status, out = daemon.post("/infill", {**body, "n_predict": 2, "temperature": 0})
    n = len(expected_ids(tok, prefix=body["input_prefix"]))
    assert status == 200 and out["tokens_evaluated"] == n
    assert out["tokens_cached"] == (n - 1) // 16 * 16


def test_infill_bad_input(daemon):
    both = {"input_prefix": "a", "input_suffix": ""}
    for body, param in (
        ({**both, "input_extra": [{"text": 5}]}, "input_extra"),
        ({**both, "input_extra": [{"name": "x"}]}, "input_extra"),
        ({**both, "input_extra": [{"filename": "a.py"}]}, "input_extra"),  # no text
        ({**both, "input_prefix": 3}, "input_prefix"),
        ({"input_suffix": "b"}, "input_prefix"),  # both required, as llama.cpp has them
        ({"input_prefix": "a"}, "input_suffix"),
        ({**both, "n_predict": CONTEXT}, "n_predict"),
    ):
        status, out = daemon.post("/infill", body)
        assert status == 400, (body, out)
        assert out["error"]["param"] == param
    # a field llama.cpp's clients send that this server does not use is accepted and named
    status, headers, raw = daemon.request("POST", "/infill", {**both, "n_predict": 1, "x_y": 1})
    assert status == 200 and json.loads(raw)["tokens_predicted"] == 1
    assert headers["X-Hetero-Ignored-Fields"] == "x_y"


def test_indent_cut_follows_llama_cpp():
    assert indent_cut("x\n    a\n    b", 4) is None
    assert indent_cut("x\n    a\n  b", 4) == len("x\n    a\n  ")
    assert indent_cut("x\n    a\n\n", 4) == len("x\n    a\n")  # an empty line ends it too
    assert indent_cut("x\n  ", 4) is None  # undecided until the line has a character
    assert indent_cut("\tx\n\t\ty", 2) is None


def test_line_limits_stop_at_a_new_line_after_the_time_limit():
    limits = LineLimits(n_indent=0, t_max_ms=1)
    time.sleep(0.01)
    assert limits.apply("", "abc") == ("abc", False)
    assert limits.apply("abc", "d\ne") == ("d\ne", True)
    indent = LineLimits(n_indent=4, t_max_ms=0)
    assert indent.apply("if x:\n    y = 1", "\nz") == ("\n", True)
    assert indent.apply("if x:\n", "    y") == ("    y", False)


def test_n_indent_holds_on_the_endpoint(daemon):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24, "n_indent": 4}
    status, out = daemon.post("/infill", {**body, "temperature": 0})
    assert status == 200, out
    lines = out["content"].split("\n")
    for line in lines[1:-1]:
        assert line.startswith("    "), json.dumps(out["content"])


def test_props_name_the_fim_tokens(daemon):
    """llama.cpp's /props: a plugin learns that /infill works here, and with which tokens."""
    status, _, raw = daemon.request("GET", "/props")
    assert status == 200
    want = {"supported": True, "prefix": RENAMED[11], "middle": RENAMED[12], "suffix": RENAMED[13]}
    assert json.loads(raw)["fim"] == want
