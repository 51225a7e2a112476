"""llama.cpp's /tokenize and /detokenize: the served model's vocabulary, without generating.

    POST /tokenize    {"content": str, "add_special": false, "parse_special": true,
                       "with_pieces": false}
                   -> {"tokens": [id, ...]}, or with_pieces {"tokens": [{"id": id, "piece": p}]}
                      where p is the token's text, or its bytes as a list of integers when they
                      are not whole UTF-8 (a piece of a character)
    POST /detokenize  {"tokens": [id, ...]}  ->  {"content": str}   (control tokens as text)

As in llama.cpp, a body without `content` (or `tokens`) gets an empty answer; types are checked
and answered in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from hetero.server.protocol import Field, bad, check_fields
from hetero.server.state import STATE, read_body

TOKENIZE_FIELDS = {
    "content": Field("string"),
    "add_special": Field("boolean"),
    "parse_special": Field("boolean"),
    "with_pieces": Field("boolean"),
}
DETOKENIZE_FIELDS = {"tokens": Field("int_array")}


def _pieces(tokenizer, ids: list[int]) -> list[dict[str, Any]]:
    out = []
    for i in ids:
        data = tokenizer.token_bytes(i)
        try:
            piece: str | list[int] = data.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(data)
        out.append({"id": i, "piece": piece})
    return out


def _tokenize(tokenizer, body: dict[str, Any]) -> dict[str, Any]:
    content = body.get("content") or ""
    ids = tokenizer.encode(
        content,
        add_special=bool(body.get("add_special")),
        parse_special=body.get("parse_special") is not False,
    )
    return {"tokens": _pieces(tokenizer, ids) if body.get("with_pieces") else ids}


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    check_fields(body, TOKENIZE_FIELDS)
    state.require_ready()
    return web.json_response(await state.off_loop(_tokenize, state.tokenizer, body))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    check_fields(body, DETOKENIZE_FIELDS)
    state.require_ready()
    tok = state.tokenizer
    ids = body.get("tokens") or []
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise bad(f"'tokens' must be token ids in [0, {tok.vocab_size})", param="tokens")
    return web.json_response({"content": await state.off_loop(tok.decode, ids)})
