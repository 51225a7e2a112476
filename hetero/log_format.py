"""The daemon's log lines: text for a person, or one JSON object per line for a log collector.

`configure(level, fmt)` sets the root logger of a process once (the server's, and the engine
process's: it inherits the choice through HETERO_LOG_FORMAT). A line written while a request is
served names that request: the server puts its id in `REQUEST_ID` (a context variable, so each
request's task sees its own), and the handler's filter copies it onto the record.

    text  2025-01-01 12:00:00,000 INFO hetero.access: POST /v1/chat/completions 200 id=... ...
    json  {"time": "2025-01-01T12:00:00.000+00:00", "level": "INFO", "logger": "hetero.access",
           "message": "POST /v1/chat/completions 200 id=...", "request_id": "...", ...fields}

A record may carry `fields` (a dict, through `extra={"fields": ...}`): the JSON format puts them
at the top level of its object (the access log's method, status, tokens and times).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextvars import ContextVar

FORMATS = ("text", "json")
FORMAT_ENV = "HETERO_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_ID: ContextVar[str | None] = ContextVar("hetero_request_id", default=None)
ACCESS_LOGGER = "hetero.access"  # its lines name the request themselves


class RequestIdFilter(logging.Filter):
    """Copies the id of the request being served (if any) onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid and record.name != ACCESS_LOGGER:
            line += f" [request {rid}]"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        obj = {
            "time": f"{stamp}.{int(record.msecs):03d}+00:00",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            obj["request_id"] = rid
        fields = getattr(record, "fields", None)
        if fields:
            obj.update(fields)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


def configure(level: int | str, fmt: str | None = None) -> str:
    """Log to stderr at `level` in `fmt` (None: the process's inherited choice, else text);
    child processes started after this inherit the format. Returns the format used."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return fmt
