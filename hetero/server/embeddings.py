"""/v1/embeddings in OpenAI's shape, from the served model or from `--embedding-model`.

    POST /v1/embeddings {"input": str | [str] | [id] | [[id]], "model"?, "encoding_format"?:
                         "float" | "base64", "dimensions"?, "user"?}
      -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
          "model": name, "usage": {"prompt_tokens": n, "total_tokens": n}}

Strings are encoded with the model's special tokens (BOS where its metadata adds one); token ids
are taken as they are. base64 is the little-endian float32 bytes, as OpenAI's client decodes
them. `dimensions` other than the model's width is refused: these models have no shortened
embeddings (Matryoshka) to give. Vectors are pooled and L2-normalized (hetero/embedding.py).

The served model answers through the engine (a forward between two steps, no KV blocks taken);
an embedding model of its own (`--embedding-model`) runs in this process on a thread of its own.
"""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from hetero.server.protocol import ApiError, Field, bad, check_fields, prompt_list
from hetero.server.sse import engine_errors
from hetero.server.state import STATE, ServerState, read_body

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
FIELDS = {
    "input": Field("prompt", required=True),
    "model": Field("string"),
    "encoding_format": Field("string"),
    "dimensions": Field("integer", 1),
    "user": Field("string"),
}


class OwnEmbedder:
    """An embedding GGUF beside the served model (`--embedding-model`), on one thread."""

    def __init__(self, path: Path, runtime) -> None:
        from hetero.embedding import Embedder
        from hetero.tokenizer import Tokenizer

        self.name = path.stem
        self.tokenizer = Tokenizer.from_gguf(path)
        self.embedder = Embedder.load(path, runtime)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hetero-embed")

    async def embed(self, prompts: list[list[int]]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.embedder, prompts)


def _inputs(value: Any, vocab_size: int) -> list[str | list[int]]:
    items = prompt_list(value, vocab_size, "input", MAX_INPUTS)
    if any(p == "" for p in items):  # OpenAI refuses them (a completion may start from nothing)
        raise bad("'input' must not hold an empty string", param="input")
    return items


def _encode(tokenizer, items: list[str | list[int]]) -> list[list[int]]:
    return [tokenizer.encode(p, add_special=True) if isinstance(p, str) else p for p in items]


def _vector(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def _source(state: ServerState, body: dict[str, Any]):
    """(name, tokenizer, embed function) of the model that answers."""
    own = state.embedder
    model = body.get("model")
    names = state.model_names if own is None else (own.name, *state.model_names)
    # any name is served, as on the chat routes, unless the operator asked for strict names
    if model is not None and model not in names and state.settings.strict_model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. This server embeds with `{names[0]}`.",
            param="model",
            code="model_not_found",
        )
    if own is not None:
        return own.name, own.tokenizer, own.embed
    return state.served_name, state.tokenizer, state.ae.embed


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    check_fields(body, FIELDS)
    state.require_ready()
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    name, tokenizer, embed = _source(state, body)
    items = _inputs(body["input"], tokenizer.vocab_size)
    prompts = await state.off_loop(_encode, tokenizer, items)
    with state.in_flight(), engine_errors():
        vectors = await embed(prompts)
    dims = body.get("dimensions")
    if dims is not None and dims != vectors.shape[1]:
        raise bad(
            f"'dimensions' {dims} is not supported: {name} gives {vectors.shape[1]}-dimensional "
            "embeddings only",
            param="dimensions",
        )
    n = sum(len(p) for p in prompts)
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(v, fmt)}
        for i, v in enumerate(vectors)
    ]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
    )
