"""The daemon with a disk KV tier: a restart finds the prefixes the last run saved at shutdown."""

from __future__ import annotations

from hetero.synth import write_synthetic
from tests.support.server_fixture import start_daemon

BLOCK = 16
TEXT = "the river model reads a long shared system prompt before every question. " * 12


def test_a_restarted_daemon_reuses_prefixes_saved_on_disk(tmp_path):
    model = write_synthetic(tmp_path / "m.gguf", "tiny-llama", "q8_0", progress=False)
    kv = tmp_path / "kv"
    args = (str(model), "--kv-disk-dir", str(kv), "--kv-ram-gb", "0.01", "--kv-dtype", "fp32",
            "--num-kv-blocks", "64", "--threads", "1")  # fmt: skip
    body = {"model": "m", "prompt": TEXT, "max_tokens": 4, "temperature": 0}
    d = start_daemon(*args)
    try:
        status, first = d.post("/v1/completions", body)
        assert status == 200, first
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        assert d.finish() == 0, d.log()
    assert len(list(kv.rglob("*.kv"))) >= len(TEXT.split()) // BLOCK  # saved at shutdown
    d = start_daemon(*args)
    try:
        status, again = d.post("/v1/completions", body)
        assert status == 200, again
        n = first["usage"]["prompt_tokens"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (n - 1) // BLOCK * BLOCK > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        m = d.metrics()
        assert m['hetero_kv_tier_hits_total{tier="disk"}'] == cached // BLOCK
        assert m['hetero_kv_tier_bytes_moved_total{direction="disk->device"}'] > 0
    finally:
        assert d.finish() == 0, d.log()
