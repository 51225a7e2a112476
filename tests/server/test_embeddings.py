"""Embeddings: the mean of SmolLM2's last hidden states, L2-normalized, against HF transformers'
(which dequantizes the GGUF exactly to float32), in process and through the real daemon with the
official `openai` client; the served model through the engine process and the engine thread, and
a second GGUF given with --embedding-model."""

from __future__ import annotations

import asyncio
import base64
import os

import numpy as np
import openai
import pytest
import torch

from hetero.config import RuntimeConfig
from hetero.embedding import Embedder, pool, pooling_of
from hetero.model.llama import load_model
from hetero.synth import write_synthetic
from hetero.tokenizer import Tokenizer
from tests.support.server_fixture import start_daemon

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "hi",
    "Embeddings index a codebase: one vector per chunk of code, " * 6,
]
FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def smol_ids(smollm2):
    return [smollm2.encode(t, add_special=True) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_vectors(smollm2_path, smol_ids) -> np.ndarray:
    """HF's last_hidden_state of each prompt alone, mean-pooled and normalized."""
    hf = transformers.AutoModel.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    rows = []
    with torch.no_grad():
        for ids in smol_ids:
            h = hf(torch.tensor([ids])).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(h.mean(0), dim=-1))
    return torch.stack(rows).numpy()


def test_smollm2_embeddings_equal_transformers(smollm2_path, smol_ids, hf_vectors):
    embedder = Embedder(*load_model(smollm2_path, RuntimeConfig(weights="dense")))
    assert embedder.pooling == "mean"  # SmolLM2 names no pooling: a chat model's default
    got = embedder(smol_ids)  # one packed forward of four prompts of different lengths
    assert got.shape == (4, 576) and got.dtype == np.float32
    assert np.abs(got - hf_vectors).max() < FP32_TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    alone = np.concatenate([embedder([ids]) for ids in smol_ids])
    assert np.abs(alone - got).max() < FP32_TOL
    with pytest.raises(ValueError, match=r"input\[1\] has no tokens"):
        embedder([[1], []])


def test_pooling_from_metadata():
    assert pooling_of({}, "llama") == "mean"
    assert pooling_of({"qwen2.pooling_type": 3}, "qwen2") == "last"
    assert pooling_of({"llama.pooling_type": 2}, "llama") == "cls"
    with pytest.raises(ValueError, match="rank"):
        pooling_of({"llama.pooling_type": 4}, "llama")
    with pytest.raises(ValueError, match="causal"):
        pooling_of({"llama.attention.causal": False}, "llama")
    hidden = torch.arange(12.0).view(6, 2) + 1  # two prompts of 2 and 4 tokens, packed
    want = {
        "cls": [[1, 2], [5, 6]],
        "last": [[3, 4], [11, 12]],
        "mean": [[2, 3], [8, 9]],
    }
    for kind, rows in want.items():
        ref = torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)
        assert torch.allclose(pool(hidden, [2, 4], kind), ref), kind


@pytest.fixture(scope="module")
def smol_daemon():
    d = start_daemon("--weights", "dense", "--num-kv-blocks", "256", "--threads", "1")
    yield d
    assert d.finish() == 0, d.log()


def client_of(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_openai_client_gets_transformers_vectors(smol_daemon, smol_ids, hf_vectors):
    client = client_of(smol_daemon)
    name = client.models.list().data[0].id
    r = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64
    assert r.model == name
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    assert np.abs(got - hf_vectors).max() < FP32_TOL
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, smol_ids))
    floats = client.embeddings.create(model=name, input=TEXTS[1], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - hf_vectors[1]).max() < FP32_TOL
    ids = client.embeddings.create(
        model=name, input=smol_ids[2], dimensions=576
    )  # one prompt of ids
    idss = client.embeddings.create(model=name, input=smol_ids[:2])  # prompts of ids
    assert np.abs(np.array(ids.data[0].embedding) - hf_vectors[2]).max() < FP32_TOL
    assert np.abs(np.array([d.embedding for d in idss.data]) - hf_vectors[:2]).max() < FP32_TOL


def test_raw_base64_and_refusals(smol_daemon, hf_vectors):
    status, body = smol_daemon.post(
        "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}
    )
    assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vec - hf_vectors[0]).max() < FP32_TOL
    cases = [
        ({"input": "x", "dimensions": 64}, "dimensions", "not supported"),
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[1, 2], [10**7]]}, "input", "token ids"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x " * 9000}, None, "at most 8192"),
        ({}, "input", "Missing required"),
    ]
    for body, param, message in cases:
        status, answer = smol_daemon.post("/v1/embeddings", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
        assert message in answer["error"]["message"], answer
    # another model name is served by the loaded model (404 only under --strict-model-name)
    status, answer = smol_daemon.post("/v1/embeddings", {"input": "x", "model": "gpt-4o"})
    assert status == 200 and answer["model"] != "gpt-4o"


def test_embeddings_beside_a_running_chat_stream(smol_daemon, hf_vectors):
    name = client_of(smol_daemon).models.list().data[0].id

    async def run():
        client = openai.AsyncOpenAI(base_url=smol_daemon.url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Count to twenty."}],
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return await asyncio.gather(
            chat, *[client.embeddings.create(model=name, input=TEXTS) for _ in range(3)]
        )

    chat, *embeds = asyncio.run(run())
    assert chat.usage.completion_tokens == 40
    for r in embeds:
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
        assert np.abs(got - hf_vectors).max() < FP32_TOL


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "tiny-chat.gguf"
    return write_synthetic(path, "tiny-llama", "q8_0", progress=False)


@pytest.mark.parametrize("own", [False, True], ids=["served-model-on-a-thread", "second-gguf"])
def test_served_model_thread_and_second_gguf(tiny_gguf, smollm2_path, hf_vectors, own):
    """The engine on a thread embeds with its own model; --embedding-model answers instead."""
    extra = ("--embedding-model", str(smollm2_path)) if own else ()
    d = start_daemon(
        str(tiny_gguf), "--no-engine-process", "--weights", "dense", "--threads", "1", *extra
    )
    try:
        client = client_of(d)
        r = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
        got = np.array([e.embedding for e in r.data], dtype=np.float32)
        if own:
            assert r.model == smollm2_path.stem and np.abs(got - hf_vectors).max() < FP32_TOL
        else:
            tok = Tokenizer.from_gguf(tiny_gguf)
            ref = Embedder(*load_model(tiny_gguf, RuntimeConfig(weights="dense")))
            want = ref([tok.encode(t, add_special=True) for t in TEXTS])
            assert r.model == "tiny-chat" and got.shape == want.shape
            assert np.abs(got - want).max() < FP32_TOL
        hi = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="tiny-chat", messages=hi, max_tokens=2)
        assert chat.model == "tiny-chat"  # generation is still the served model's
    finally:
        assert d.finish() == 0, d.log()
