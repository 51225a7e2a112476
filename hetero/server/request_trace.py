"""`--log-requests FILE`: one JSON line per generation request, for debugging a model.

What the engine was given and what it did, token by token: the rendered prompt (the chat
template's text, where there is one, else the prompt ids decoded with their special tokens),
the prompt's token ids, each sequence's output ids with their logprobs, the sampling
parameters, and the engine's timeline of it (engine/timeline.py: queueing, restore from the RAM
or disk tier, each prefill chunk and decode step with the stages and devices it ran on). A
template or tokenizer bug shows here: the text and the ids are side by side.

    {"request_id": "...", "method": "POST", "path": "/v1/chat/completions", "status": 200,
     "model": "...", "ttft_s": 0.08, "total_s": 0.41, ..., "sequences": [
        {"id": "chatcmpl-.../0", "prompt_text": "<|im_start|>user\\n...", "prompt_ids": [...],
         "output_ids": [...], "output_logprobs": [...], "output_text": "...",
         "finish_reason": "stop", "params": {...}, "timing": {"queue_s": ..., ...},
         "steps": [{"step": 12, "kind": "prefill", "tokens": 31, "start_s": 0.001,
                    "seconds": 0.05, "batch": 2, "stages": [["cpu", 0.049]]}, ...]}]}

Values are bounded (MAX_TEXT characters of text, MAX_IDS ids per list; what was cut is named in
"truncated" with its full length), and the file is rotated by size (FILE.1 .. FILE.BACKUPS).
The line is built and written on a worker thread, off the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MAX_TEXT = 32_768  # characters of one text value
MAX_IDS = 16_384  # entries of one list of ids or logprobs
BACKUPS = 3  # rotated files kept beside the current one
STEP_RECORDS = 256  # engine steps each request reports (EngineConfig.trace_steps)


class TraceWriter:
    def __init__(self, path: str | Path, max_bytes: int, tokenizer_of) -> None:
        """`tokenizer_of`: a callable giving the served tokenizer (loaded after this starts)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=BACKUPS, encoding="utf-8"
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.tokenizer_of = tokenizer_of
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetero-trace")
        self._lock = threading.Lock()

    def write(self, record, fields: dict[str, Any]) -> None:
        """Queue the trace of a finished request (its Jobs no longer change)."""
        self._pool.submit(self._write, record, dict(fields))

    def _write(self, record, fields: dict[str, Any]) -> None:
        try:
            line = json.dumps(trace_of(record, fields, self.tokenizer_of()), ensure_ascii=False)
        except Exception:  # a trace must never take the server down; say why in its log
            logging.getLogger("hetero.server").exception("request trace failed")
            return
        entry = logging.LogRecord("hetero.trace", logging.INFO, "", 0, line, None, None)
        with self._lock:
            self.handler.emit(entry)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.handler.close()


def open_trace(state) -> TraceWriter | None:
    """The daemon's trace file, when --log-requests names one."""
    s = state.settings
    if s.log_requests is None:
        return None
    return TraceWriter(s.log_requests, int(s.log_requests_max_mb * 2**20), lambda: state.tokenizer)


def trace_of(record, fields: dict[str, Any], tokenizer) -> dict[str, Any]:
    """The trace object of one finished request (a RequestRecord and its log fields)."""
    cut: dict[str, int] = {}
    out = dict(fields)
    seqs = []
    for job in record.jobs:
        for c in job.choices:
            seqs.append(_sequence(record, job, c, tokenizer, cut, f"{len(seqs)}."))
    out["sequences"] = seqs
    if cut:
        out["truncated"] = cut
    return out


def _sequence(record, job, c, tokenizer, cut: dict[str, int], key: str) -> dict[str, Any]:
    prompt_ids = job.prompts[c.prompt]
    text = record.prompt_text
    if text is None or len(job.prompts) > 1:
        text = tokenizer.decode(prompt_ids, skip_special=False)
    out_ids = c.stream.out.token_ids
    seq: dict[str, Any] = {
        "id": f"{job.id}/{c.index}",
        "prompt_text": text,
        "prompt_ids": list(prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "cached_tokens": c.cached_tokens,
        "output_ids": list(out_ids),
        "output_logprobs": (c.logprobs or [])[: len(out_ids)],
        "output_text": c.stream.out.text,
        "finish_reason": c.stream.out.finish_reason if c.finished else "cancelled",
        "params": _params(c.stream.params),
    }
    bound(seq, cut, key)
    if c.error:
        seq["error"] = c.error
    tl = c.timeline
    if tl is not None:
        seq["timing"] = tl.summary()
        seq["steps"] = [dataclasses.asdict(s) for s in tl.steps]
        if tl.steps_dropped:
            seq["steps_dropped"] = tl.steps_dropped
    return seq


def bound(obj: dict[str, Any], cut: dict[str, int], prefix: str = "") -> None:
    """Cut `obj`'s long strings to MAX_TEXT characters and long lists to MAX_IDS entries, in
    place; `cut` gets prefix + key -> the full length of each value cut."""
    for key, v in obj.items():
        limit = MAX_TEXT if isinstance(v, str) else MAX_IDS if isinstance(v, list) else None
        if limit is not None and len(v) > limit:
            cut[prefix + key] = len(v)
            obj[key] = v[:limit]


def _params(p) -> dict[str, Any]:
    """The sampling parameters as JSON values (the structured-output spec in words)."""
    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
        elif isinstance(v, (list, tuple)):
            out[f.name] = list(v)
        elif isinstance(v, dict):
            out[f.name] = {str(k): x for k, x in v.items()}
        else:
            out[f.name] = repr(v)[:MAX_TEXT]
    return out
