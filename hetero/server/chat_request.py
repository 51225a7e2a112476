"""A chat request made ready for the engine: its prompt, and how its answers are to be read.

Both chat APIs (OpenAI's /v1/chat/completions and Anthropic's /v1/messages) reduce a request to a
`ChatInput` in OpenAI's terms and call `chat_prompt` on the tokenizer threads. It renders the
messages and tools with the model's own template (or, for templates without tool support, the
generic rewrite: tool_parsers/generic.py), encodes the text, and says how the answer is read: the
tool-call format (none under tool_choice "none"), and whether `<think>` reasoning is split off.
Where `tool_choice` forces a call ("required", a named function), the prompt carries the grammar
of that call in the model's format (tool_grammars.py), which the engine decodes under.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero.chat_output import ChatFormat
from hetero.chat_template import ChatTemplateError, check_messages
from hetero.plain_content import Masked
from hetero.reasoning import CLOSE, prompt_opens_thinking, template_thinks
from hetero.server.protocol import bad
from hetero.server.tool_checks import check_history, check_tool_choice, check_tools
from hetero.structured_outputs import StructuredOutputsParams
from hetero.tool_grammars import forced_call, forced_call_grammar
from hetero.tool_parsers import ToolFormat, detect_format
from hetero.tool_parsers.generic import rewrite

EFFORTS = ("none", "minimal", "low", "medium", "high")
_RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt")


@dataclass
class ChatInput:
    messages: Any
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, str] = "none"
    parallel: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    id_prefix: str = "call_"  # of the ids of the calls the answer makes
    ignored: list[str] = field(default_factory=list)  # fields the template does not read


@dataclass
class ChatPrompt:
    ids: list[int]
    text: str
    format: ChatFormat | None  # None: the answer is plain content, read as it comes
    special_tokens: bool = False  # the answer's control tokens are text the parser reads
    constraint: StructuredOutputsParams | None = None  # the forced call's grammar


def openai_input(body: dict[str, Any]) -> ChatInput:
    """The chat fields of an OpenAI request body (checked by protocol.check_fields already)."""
    tools = check_tools(body["tools"]) if body.get("tools") else None
    kwargs = dict(body.get("chat_template_kwargs") or {})
    for key in _RESERVED_KWARGS:
        if key in kwargs:
            raise bad(
                f"'chat_template_kwargs' cannot set {key!r}: it is a field of the request",
                param="chat_template_kwargs",
            )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad(
                f"Invalid value for 'reasoning_effort': {effort!r}; use one of "
                f"{', '.join(EFFORTS)}",
                param="reasoning_effort",
            )
        kwargs.setdefault("reasoning_effort", effort)
    add = body.get("add_generation_prompt")
    return ChatInput(
        body["messages"],
        tools,
        check_tool_choice(body.get("tool_choice"), tools),
        body.get("parallel_tool_calls") is not False,
        kwargs,
        True if add is None else add,
    )


def chat_prompt(tokenizer, chat: ChatInput, plain_content: bool = True) -> ChatPrompt:
    """Render and encode (runs on the tokenizer threads: templates can be slow). plain_content:
    control-token texts in the messages and tools are text (plain_content.py)."""
    try:
        template = tokenizer.template_for(chat.tools)
        fmt = detect_format(template)
        messages = check_messages(chat.messages)
        check_history(messages, fmt.id_length)
        masked = Masked(tokenizer, messages, chat.tools) if plain_content else None
        if masked is not None and masked.found:
            rendered = _render(tokenizer, fmt, masked.messages, masked.tools, chat)
            text, ids = masked.restore(rendered), masked.encode(rendered)
        else:
            text = _render(tokenizer, fmt, messages, chat.tools, chat)
            ids = tokenizer.encode(text)
    except ChatTemplateError as e:
        raise bad(str(e), param="messages") from e
    if "reasoning_effort" in chat.template_kwargs and "reasoning_effort" not in template:
        chat.ignored.append("reasoning_effort")
    thinks = template_thinks(template)
    parse = chat.tools is not None and chat.tool_choice != "none"
    if not parse and not thinks and fmt.name != "harmony":
        return ChatPrompt(ids, text, None)
    read = ChatFormat(
        fmt if parse or fmt.name == "harmony" else None,
        chat.tools or (),
        chat.parallel,
        thinks=thinks,
        in_reasoning=thinks and prompt_opens_thinking(text),
        id_prefix=chat.id_prefix,
        tools_enabled=parse,
    )
    prompt = ChatPrompt(ids, text, read, parse and fmt.special_tokens)
    forced = forced_call(chat.tools, chat.tool_choice, chat.parallel)
    if forced is not None:
        reasoning = _reasoning(text) if thinks else None
        grammar = forced_call_grammar(tokenizer, fmt.name, template, forced, reasoning)
        prompt.constraint = StructuredOutputsParams(grammar=grammar)
    return prompt


def _reasoning(prompt: str) -> str | None:
    """Where a forced call's answer stands with a think block: "open" (the prompt opened it),
    None (the prompt closed one: Qwen3 with thinking off), else "may" (the answer may open one)."""
    if prompt_opens_thinking(prompt):
        return "open"
    return None if prompt.rstrip().endswith(CLOSE) else "may"


def _render(tokenizer, fmt: ToolFormat, messages: list[dict], tools, chat: ChatInput) -> str:
    kw = dict(chat.template_kwargs, add_generation_prompt=chat.add_generation_prompt)
    if fmt.native:
        return tokenizer.apply_chat_template(messages, tools=tools, **kw)
    try:  # the tools described in a system message; in the first user message where refused
        return tokenizer.apply_chat_template(rewrite(messages, tools), **kw)
    except ChatTemplateError:
        if not tools:
            raise
        return tokenizer.apply_chat_template(rewrite(messages, tools, in_user=True), **kw)
