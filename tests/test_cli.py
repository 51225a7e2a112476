"""The console scripts as a user runs them (real subprocesses, the default model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(BIN / "hetero"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=check,
    )


def test_tokenize_prints_json_ids(smollm2_path):
    from hetero.tokenizer import Tokenizer

    out = run("tokenize", "--text", "Hello, world! 12345")
    ids = json.loads(out.stdout)
    assert ids == Tokenizer.from_gguf(smollm2_path).encode("Hello, world! 12345")
    assert run("tokenize", str(smollm2_path), "--text", "Hello, world! 12345").stdout == out.stdout


def test_generate_default_model_greedy_matches_library(smollm2_path):
    from hetero.generate import generate_ids
    from hetero.model.llama import load_model
    from hetero.tokenizer import Tokenizer

    out = run("generate", "-p", "The capital of France is", "--max-tokens", "12", "--no-stats")
    tok = Tokenizer.from_gguf(smollm2_path)
    _, model = load_model(smollm2_path)
    ids = tok.encode("The capital of France is", add_special=True)
    expect = tok.decode(list(generate_ids(model, ids, 12, stop_ids=tok.eos_ids)), skip_special=True)
    assert out.stdout.rstrip("\n") == expect
    assert "loading layers" in out.stderr  # the progress bar


def test_generate_chat_streams_and_reports_speed():
    out = run(
        "generate", "--chat", "-p", "Say hi.", "--max-tokens", "8", "--seed", "3", "-t", "0.7"
    )
    assert out.stdout.strip()
    assert "tok/s" in out.stderr and "prompt tokens" in out.stderr


def test_info(smollm2_path):
    out = run("info").stdout
    assert "30 layers" in out and "Q4_1" in out and "Q8_0" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "/nonexistent/model.gguf", "-p", "x"], "not found"),
        (["generate", "-p", "x", "--max-tokens", "0"], "max-tokens"),
        (["generate", "-p", "x", "--max-tokens", "9000"], "exceeds the model's context"),
        (["tokenize", __file__, "--text", "x"], "not a GGUF file"),
    ],
)
def test_clear_errors(args, message):
    out = run(*args, check=False)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
