"""llama.cpp's tooling endpoints: GET /props and GET /slots, in llama-server's shapes.

Editor plugins and front ends written for llama-server read these: /props for the context size,
the chat template, whether fill-in-the-middle works (our addition: `fim`, with its tokens), and
the build; /slots for what each running request holds. llama-server has a fixed number of
slots and lists them all; here a slot is a running sequence (`total_slots` in /props is how
many may run at once), so /slots lists the busy ones.
"""

from __future__ import annotations

import platform
from typing import Any

from aiohttp import web

from hetero.server.access_log import ACCESS
from hetero.server.state import STATE
from hetero.server.status_data import hetero_version


def _params(p) -> dict[str, Any]:
    """A sequence's sampling parameters under llama-server's names."""
    return {
        "n_predict": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": p.seed,
        "stop": list(p.stop),
        "n_probs": p.logprobs or 0,
        "ignore_eos": p.ignore_eos,
    }


async def props(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info, ae = state.require_ready()
    tok = ae.tokenizer
    fim = tok.fim
    supported = all(getattr(fim, r) is not None for r in ("prefix", "suffix", "middle"))
    text = tok.id_to_token
    return web.json_response(
        {
            "default_generation_settings": {
                "n_ctx": info.max_model_len,
                "params": _params(_defaults()),
            },
            "total_slots": info.max_num_seqs,
            "n_ctx": info.max_model_len,
            "model_path": str(state.settings.model_path),
            "model_alias": state.served_name,
            "chat_template": tok.chat_template or "",
            "bos_token": text(tok.bos_id) if tok.bos_id is not None else "",
            "eos_token": text(tok.eos_id) if tok.eos_id is not None else "",
            "fim": {
                "supported": supported,
                **{
                    r: text(getattr(fim, r))
                    for r in ("prefix", "suffix", "middle")
                    if getattr(fim, r) is not None
                },  # fmt: skip
            },
            "modalities": {"vision": False, "audio": False},
            "build_info": f"hetero {hetero_version()} (Python {platform.python_version()})",
        }
    )


def _defaults():
    from hetero.sampling import SamplingParams

    return SamplingParams()


async def slots(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info, _ = state.require_ready()
    out = []
    for record in list(request.app[ACCESS].active.values()):
        for job in record.jobs:
            for c in job.choices:
                if c.finished:
                    continue
                out.append(_slot(len(out), record, job, c, info))
    return web.json_response(out)


def _slot(i: int, record, job, c, info) -> dict[str, Any]:
    prompt = len(job.prompts[c.prompt])
    decoded = len(c.stream.out.token_ids)
    p = c.stream.params
    tokens = prompt + decoded
    return {
        "id": i,
        "id_task": f"{job.id}/{c.index}",
        "request_id": record.id,
        "n_ctx": info.max_model_len,
        "is_processing": True,
        "started": c.started,  # admitted by the engine (else queued)
        "params": _params(p),
        "n_prompt_tokens": prompt,
        "n_cached_tokens": c.cached_tokens,
        "kv_tokens": tokens if c.started else 0,
        "kv_blocks": -(-tokens // info.block_size) if c.started else 0,
        "next_token": {
            "has_next_token": True,
            "n_decoded": decoded,
            "n_remain": max(0, p.max_tokens - decoded),
        },
    }
