"""The requests of the soak test (soak.py) and how each answer is checked.

Kinds, drawn by weight: plain and streamed chat, chat with logprobs, JSON mode, n=2, a long
prompt (a few thousand tokens of shared and private text), fill-in-the-middle, and a few
requests over a limit (a prompt past the context, max_tokens past it, a body past
--max-request-bytes, n, top_logprobs and stop past their bounds). Some streamed requests are cut
by their client after a few events; some plain ones are abandoned before the answer comes.

A finished answer must be complete: every choice ends with "stop" or "length", its usage adds
up (a "length" choice has exactly max_tokens tokens; logprobs, one per token), a JSON-mode answer
that stopped is a JSON object, a stream ends with [DONE] after one finish reason per choice and
its usage. A 4xx must name its cause: a message, and for the planned over-limit requests the
field or limit it broke. Anything else is a problem, listed with the request.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "river mill bridge market bread boat town stone light morning window street garden "
    "letter lamp field winter summer harbor tower song table door road"
).split()

# kind -> weight (per 100 requests)
MIX = {
    "chat": 22,
    "chat_stream": 22,
    "logprobs": 10,
    "json": 10,
    "n2": 10,
    "long": 6,
    "fim": 12,
    "over_limit": 3,
}
OVER_LIMITS = ("context", "max_tokens", "body", "n", "top_logprobs", "stop")


@dataclass
class Planned:
    kind: str
    path: str
    body: dict[str, Any] | bytes
    stream: bool = False
    cut_after: int | None = None  # events read before the client leaves
    abandon_s: float | None = None  # seconds before a plain request is given up
    # for a request that must be refused: (field of the error, what it says) its 4xx must name,
    # a field being "param", "code" or "message" (a phrase in it)
    expect: tuple[str, str] | None = None
    n: int = 1
    max_tokens: int = 0


@dataclass
class Planner:
    """Draws requests; `max_bytes` is the daemon's --max-request-bytes, `fim` whether its model
    has fill-in-the-middle tokens (without them FIM requests must be refused, saying so)."""

    rng: random.Random
    max_bytes: int
    context: int
    fim: bool = True
    cut_streams: float = 0.15  # share of streams whose client leaves after a few events
    abandon: float = 0.05  # share of plain requests whose client gives up before the answer
    # kinds in turn (over-limit ones as "over_context" ...) instead of drawn by weight
    order: list[str] | None = None
    shared: str = field(init=False)

    def __post_init__(self) -> None:
        # the long prompts' common start: prefix-cache hits
        self.shared = self.text(min(400, self.context // 10))
        self._turn = 0

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def draw(self) -> Planned:
        if self.order:
            kind = self.order[self._turn % len(self.order)]
            self._turn += 1
        else:
            kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind.startswith("over_"):  # "over_limit": one drawn; "over_n": that one
            return self._over_limit(None if kind == "over_limit" else kind[5:])
        return getattr(self, f"_{kind}")()

    def _chat_body(self, words: int, max_tokens: int, **extra) -> dict[str, Any]:
        messages = [{"role": "user", "content": f"Tell me about the {self.text(words)}."}]
        return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.7, **extra}

    def _plain(self, kind: str, body: dict, n: int = 1) -> Planned:
        abandon = self.rng.uniform(0.05, 2.0) if self.rng.random() < self.abandon else None
        return Planned(kind, "/v1/chat/completions", body, abandon_s=abandon, n=n,
                       max_tokens=body["max_tokens"])  # fmt: skip

    def _chat(self) -> Planned:
        return self._plain("chat", self._chat_body(8, self.rng.randint(4, 48)))

    def _chat_stream(self) -> Planned:
        body = self._chat_body(8, self.rng.randint(4, 48), stream=True)
        body["stream_options"] = {"include_usage": True}
        cut = self.rng.randint(1, 4) if self.rng.random() < self.cut_streams else None
        return Planned("chat_stream", "/v1/chat/completions", body, True, cut,
                       max_tokens=body["max_tokens"])  # fmt: skip

    def _logprobs(self) -> Planned:
        body = self._chat_body(6, self.rng.randint(4, 24), logprobs=True, top_logprobs=2)
        return self._plain("logprobs", body)

    def _json(self) -> Planned:
        body = self._chat_body(6, 48, response_format={"type": "json_object"})
        body["messages"][0]["content"] += " Answer in JSON."
        return self._plain("json", body)

    def _n2(self) -> Planned:
        return self._plain("n2", self._chat_body(6, self.rng.randint(4, 24), n=2), n=2)

    def _long(self) -> Planned:
        body = self._chat_body(20, self.rng.randint(4, 16))
        most = max(50, self.context // 4 - len(self.shared.split()))  # about 2 tokens a word
        system = f"Read this first. {self.shared} {self.text(self.rng.randint(most // 4, most))}"
        body["messages"].insert(0, {"role": "system", "content": system})
        return self._plain("long", body)

    def _fim(self) -> Planned:
        body = {
            "prompt": f"def {self.rng.choice(WORDS)}(x):\n    ",
            "suffix": "\n    return x\n",
            "max_tokens": self.rng.randint(4, 32),
            "temperature": 0.2,
        }
        expect = None if self.fim else ("code", "fim_not_supported")
        return Planned("fim", "/v1/completions", body, expect=expect,
                       max_tokens=body["max_tokens"])  # fmt: skip

    def _over_limit(self, which: str | None = None) -> Planned:
        which = which or self.rng.choice(OVER_LIMITS)
        body: dict[str, Any] | bytes = self._chat_body(4, 8)
        expect = ("param", which)
        if which == "context":
            expect = ("code", "context_length_exceeded")
            body["messages"][0]["content"] = self.text(int(self.context * 1.2))
        elif which == "max_tokens":
            body["max_tokens"] = self.context * 4
        elif which == "body":
            body = json.dumps(self._chat_body(self.max_bytes // 4, 8)).encode()
            expect = ("message", "bytes")
        elif which == "n":
            body["n"] = 129
        elif which == "top_logprobs":
            body.update(logprobs=True, top_logprobs=21)
        else:
            body["stop"] = [f"s{i}" for i in range(65)]
        return Planned(f"over_{which}", "/v1/chat/completions", body, expect=expect)


# -- checks -----------------------------------------------------------------------------------


def check_error(p: Planned, status: int, body: Any) -> str | None:
    """A 4xx must say why, in OpenAI's shape; a planned one must name what it broke."""
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str) or not message.strip():
        return f"{p.kind}: HTTP {status} without an error message: {body!r:.300}"
    if p.expect is None:
        return f"{p.kind}: unexpected HTTP {status}: {message:.300}"
    where, what = p.expect
    named = what in message.lower() if where == "message" else err.get(where) == what
    if not named:
        return f"{p.kind}: HTTP {status} does not name {where} {what!r}: {err!r:.300}"
    return None


def check_answer(p: Planned, body: dict[str, Any]) -> str | None:
    """A plain (non-streamed) 200 answer."""
    choices, usage = body.get("choices") or [], body.get("usage") or {}
    if len(choices) != p.n:
        return f"{p.kind}: {len(choices)} choices, asked {p.n}"
    tokens = usage.get("completion_tokens")
    reasons = [c.get("finish_reason") for c in choices]
    if any(r not in ("stop", "length") for r in reasons):
        return f"{p.kind}: finish reasons {reasons}"
    if all(r == "length" for r in reasons) and tokens != p.n * p.max_tokens:
        return f"{p.kind}: {tokens} tokens, all choices stopped at the length {p.max_tokens}"
    for c in choices:
        text = c.get("text") if p.kind == "fim" else (c.get("message") or {}).get("content")
        if not isinstance(text, str):
            return f"{p.kind}: choice {c.get('index')} has no text"
        if p.kind == "json" and c["finish_reason"] == "stop" and not _is_object(text):
            return f"{p.kind}: a stopped JSON-mode answer is not a JSON object: {text!r:.200}"
    if p.kind == "logprobs":
        content = (choices[0].get("logprobs") or {}).get("content") or []
        if len(content) != tokens or any(len(t.get("top_logprobs", ())) != 2 for t in content):
            return f"{p.kind}: {len(content)} logprobs (top 2 each) for {tokens} tokens"
    return None


def check_stream(p: Planned, events: list[Any]) -> str | None:
    """A streamed answer read to its end: [DONE] last, no error, a finish reason per choice and
    the usage (include_usage)."""
    if not events or events[-1] != "[DONE]":
        return f"{p.kind}: the stream did not end with [DONE]"
    chunks = events[:-1]
    if any(isinstance(e, dict) and "error" in e for e in chunks):
        return f"{p.kind}: error event {next(e for e in chunks if 'error' in e)!r:.300}"
    reasons = [c["finish_reason"] for e in chunks for c in e.get("choices", ()) if
               c.get("finish_reason")]  # fmt: skip
    if len(reasons) != p.n or any(r not in ("stop", "length") for r in reasons):
        return f"{p.kind}: finish reasons {reasons}"
    usage = chunks[-1].get("usage") if chunks else None
    if not usage:
        return f"{p.kind}: no usage chunk"
    if reasons == ["length"] * p.n and usage["completion_tokens"] != p.n * p.max_tokens:
        return f"{p.kind}: {usage['completion_tokens']} tokens, stopped at the length"
    return None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
