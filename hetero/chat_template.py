"""Render chat messages with a model's Jinja chat template, the way HF transformers does.

Templates come with model files, so they are untrusted code: they run in Jinja's
`ImmutableSandboxedEnvironment` with HF's settings (`trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension) and HF's helpers (`raise_exception`, a `tojson` that does not escape
HTML, `strftime_now`, a safe `dict` and `namespace`, and a no-op `{% generation %}` block).
Any failure while compiling or rendering becomes `ChatTemplateError`, a `ValueError`, so a server
can answer 400 instead of 500.

Messages are checked before rendering: each needs a string `role` and a `content` that is a string
or a list of `{"type": "text", "text": ...}` parts (joined with newlines, as vLLM does, because
most templates concatenate `content` as a string). An assistant message may carry `tool_calls`
with `content` null or left out (rendered as ""), where the template renders tool calls (a clear
error where it does not).
The `developer` role is `system` for templates that do not name it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# HF's old default template, used for vocabularies that have `<|im_start|>` but ship no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# HF copies a message's reasoning under all of these names; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or the messages were refused."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF.

    Rendering only needs the body, so the block renders it unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (a path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, as in Jinja's Namespace, so `namespace(self=...)` still works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Rebuild a value from JSON types only, so a template never sees an object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # Subclasses (str enums, int flags) are cut back to the base type and lose their methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(
            f"{where}: 'content' must be a string or a list of text parts, "
            f"not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            found = repr(kind) if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"{where}: content part {j} must be {{'type': 'text', 'text': ...}}, got {found}"
            )
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}: content part {j} has no string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(
            f"{where} must be an object with 'role' and 'content', not {type(message).__name__}"
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"{where} needs a non-empty string 'role'")
    calls = role == "assistant" and message.get("tool_calls")  # content may be left out
    if "content" not in message and not calls:
        raise ChatTemplateError(f"{where} ({role}) has no 'content'")
    content = message.get("content")
    if content is None and not calls:
        raise ChatTemplateError(f"{where} ({role}) has null 'content'")
    # Keys set to None are dropped (as HF does): templates test for missing keys, not for None.
    out = {str(k): _plain(v) for k, v in message.items() if v is not None}
    # A call's message without text gets "" (as vLLM and llama.cpp hand it): templates read
    # `message.content` as a string (Qwen3's splits it), and None would fail them.
    out["content"] = "" if content is None else _content_text(content, f"{where} ({role})")
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated plain copies of the messages, content joined to a string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    return [_check_message(m, i) for i, m in enumerate(messages)]


def _for_template(chat: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """OpenAI's `developer` role is the system role of templates that do not know it (as OpenAI
    maps it for models that predate it); `tool_calls` that the template never reads are refused,
    not silently dropped from the history."""
    out = []
    for i, m in enumerate(chat):
        if m["role"] == "developer" and "developer" not in template:
            m = {**m, "role": "system"}
        if "tool_calls" in m and "tool_calls" not in template:
            raise ChatTemplateError(
                f"messages[{i}] ({m['role']}) carries 'tool_calls', which this model's chat "
                "template does not render"
            )
        out.append(m)
    return out


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages` under `template` (compiled once per distinct template)."""
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("the chat template is empty")
    if tools is not None and (
        not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)
    ):
        raise ChatTemplateError("tools must be a list of JSON objects")
    chat = _for_template(check_messages(messages), template)
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e
    context = _plain({"bos_token": bos_token, "eos_token": eos_token, **extra})
    context.setdefault("documents", None)
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(tools),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
