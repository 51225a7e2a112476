r"""Forced tool calls: a grammar per tool-call format, so that the answer is a valid call.

`tool_choice: "required"` (Anthropic's `any`) and a named function (`{"type": "function", ...}`,
Anthropic's `tool`) constrain decoding (structured_outputs.py, engine/grammar_mask.py) to the
calls the model's format writes, each function's arguments held to its `parameters` schema.
`required` allows any of the tools, and a run of calls when parallel calls are on; a named
function allows that one, called once. The grammar ends with the last call, so the request ends
there (finish_reason "tool_calls"); where more calls may follow, end-of-sequence is allowed.

What the answer must be, per format (NAME and the arguments chosen per call; [X] a control token
of the vocabulary where it is one, else the text):

    hermes, generic  <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>   joined by \n
    qwen3_coder      <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
                     </function>\n</tool_call>                                      joined by \n
    llama3_json      {"name": NAME, "parameters": ARGS}                            joined by "; "
    mistral          [TOOL_CALLS][{"name": NAME, "arguments": ARGS}, ...]   (one array; an "id"
                     of 9 letters and digits may follow the arguments, as Nemo's template writes)
                     [TOOL_CALLS]NAME[ARGS]ARGS                  (templates that write [ARGS])
    harmony          <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
                     (one call: <|call|> ends gpt-oss's turn)

ARGS is `%json` of the function's schema (its `$defs` lifted to the root of the call object, so
`#/$defs/...` references still resolve), compiled leniently: keywords llguidance does not
implement (`not`, `if`/`then`, `uniqueItems`, unknown formats ...) are not enforced, where a
`response_format` schema would be refused, because agents send whatever schemas their tools
have, and a call that keeps the rest is worth more than a 400. What cannot be compiled at all (a
pattern with look-around, a reference to nothing) is a 400 naming `tools`.

In the XML form the schema's properties come in its order, the required ones always, the others
optionally, no others. A value is the parameter's raw text where the schema types it as a string
(an enum or const: one of its strings; maxLength and minLength bound the characters; `pattern`
and `format` are not enforced there), and JSON of its schema otherwise, as Qwen's parser reads
them. A text value ends at its first `</parameter>`, so none holds one.

Reasoning stays possible, bounded: a template that thinks (`<think>`) may open a think block
before the calls unless its prompt closed one (a prompt that opened one continues it), and
gpt-oss may write one analysis message first. Each holds at most THINK_CHARS characters, then
its closing marker is forced: a weak model cannot think forever and never call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetero.structured_outputs import json_rule, lark_string

THINK_CHARS = 8192  # the most characters of reasoning before a forced call (~2k tokens)
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


@dataclass(frozen=True)
class ForcedCall:
    """Which calls the answer must make: one of `functions` (name -> parameters schema), and
    more than one call allowed when `several`."""

    functions: Mapping[str, Mapping[str, Any]]
    several: bool


def forced_call(
    tools: Sequence[Mapping[str, Any]] | None, choice: str | Mapping[str, str], parallel: bool
) -> ForcedCall | None:
    """What `tool_choice` forces (checked already: check_tool_choice); None: nothing."""
    if not tools or choice in ("none", "auto"):
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    schemas = {name: s if s is not None else _NO_PARAMETERS for name, s in schemas.items()}
    if isinstance(choice, Mapping):
        return ForcedCall({choice["name"]: schemas[choice["name"]]}, several=False)
    return ForcedCall(schemas, several=parallel)


def tool_json(schema: Mapping[str, Any]) -> str:
    """`%json` of a tool's schema (or of a call object holding it), lenient (see above)."""
    options = {"lenient": True, **schema.get("x-guidance", {})}
    return json_rule({**schema, "x-guidance": options})


def _regex_text(text: str) -> str:
    """`text` as a literal inside a Lark `/.../` regex (Rust syntax)."""
    return "".join("\\" + c if c in _REGEX_META else "\\n" if c == "\n" else c for c in text)


def text_until(close: str, max_chars: int | None = None, optional: str = "") -> str:
    """A Lark regex: at most `max_chars` characters (any number for None), then `optional` or
    not, then `close`. Its rule must be lazy (`name[lazy]: ...`): the lexeme ends at the first
    `close`, so none can occur inside it."""
    count = f"{{0,{max_chars}}}" if max_chars is not None else "*"
    maybe = f"(?:{_regex_text(optional)})?" if optional else ""
    return f"/(?s:.){count}{maybe}{_regex_text(close)}/"


class LarkBuilder:
    """Rules of one grammar, and the vocabulary's markers: a marker that is one control token is
    named by its id (`<[128010]>`: control tokens never match text), any other is text."""

    def __init__(self, tokenizer, think_chars: int = THINK_CHARS) -> None:
        self.tokenizer = tokenizer
        self.think_chars = think_chars
        self.lines: list[str] = []

    def add(self, name: str, body: str, lazy: bool = False) -> str:
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def is_control(self, text: str) -> bool:
        i = self.tokenizer.token_to_id(text)
        return i is not None and self.tokenizer.is_special(i)

    def mark(self, text: str) -> str:
        if self.is_control(text):
            return f"<[{self.tokenizer.token_to_id(text)}]>"
        return lark_string(text)

    def until(self, name: str, close: str) -> str:
        """Reasoning: text of at most `think_chars` characters, then the marker `close`."""
        if self.is_control(close):  # a control token cannot occur in text: it ends the text
            upper = self.add(name.upper(), f"/(?s:.){{0,{self.think_chars}}}/")
            return self.add(name, f"{upper} {self.mark(close)}")
        return self.add(name, text_until(close, self.think_chars), lazy=True)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def call_object(
    name: str, params: Mapping[str, Any], key: str = "arguments", id_: bool = False
) -> str:
    """`%json` of `{"name": NAME, key: ARGS}`, in that order (the streaming parsers read the name
    first), the parameters' `$defs` at the root where their references point. `id_`: an optional
    `"id"` of 9 letters and digits may follow, as Mistral's templates write past calls."""
    params = dict(params)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    properties: dict[str, Any] = {"name": {"const": name}, key: params}
    if id_:
        properties["id"] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
    schema = {
        "type": "object",
        "properties": properties,
        "required": ["name", key],
        "additionalProperties": False,
        **defs,
    }
    return tool_json(schema)


def _alternatives(g: LarkBuilder, forced: ForcedCall, body) -> str:
    """One rule per function, `fn_I: body(name, schema, I)`, and the rule choosing among them."""
    names = [
        g.add(f"fn_{i}", body(name, schema, i))
        for i, (name, schema) in enumerate(forced.functions.items())
    ]
    return g.add("function", " | ".join(names))


def _joined(g: LarkBuilder, one: str, forced: ForcedCall, separator: str) -> str:
    if not forced.several:
        return g.add("calls", one)
    return g.add("calls", f"{one} ({lark_string(separator)} {one})*")


# -- the formats ----------------------------------------------------------------------------------

NL = lark_string("\n")


def _hermes(g: LarkBuilder, forced: ForcedCall, template: str) -> str:
    fn = _alternatives(g, forced, lambda name, schema, i: call_object(name, schema))
    call = g.add("tool_call", f"{g.mark('<tool_call>')} {NL} {fn} {NL} {g.mark('</tool_call>')}")
    return _joined(g, call, forced, "\n")


def _llama3(g: LarkBuilder, forced: ForcedCall, template: str) -> str:
    fn = _alternatives(g, forced, lambda name, schema, i: call_object(name, schema, "parameters"))
    return _joined(g, fn, forced, "; ")


def _mistral(g: LarkBuilder, forced: ForcedCall, template: str) -> str:
    marker = g.mark("[TOOL_CALLS]")
    if "[ARGS]" in template:  # tokenizer v11 and later: a marker per call
        args = g.mark("[ARGS]")
        fn = _alternatives(
            g, forced, lambda name, schema, i: f"{lark_string(name)} {args} {tool_json(schema)}"
        )
        return _joined(g, g.add("tool_call", f"{marker} {fn}"), forced, "")
    fn = _alternatives(g, forced, lambda name, schema, i: call_object(name, schema, id_=True))
    items = f'{fn} (", " {fn})*' if forced.several else fn
    return g.add("calls", f'{marker} "[" {items} "]"')


def _harmony(g: LarkBuilder, forced: ForcedCall, template: str) -> str:
    channel, message = g.mark("<|channel|>"), g.mark("<|message|>")
    body = g.until("analysis_body", "<|end|>")
    g.add("analysis", f'{channel} "analysis" {message} {body} {g.mark("<|start|>")} "assistant"')

    def header(name: str, schema: Mapping[str, Any], i: int) -> str:
        to = lark_string(f"commentary to=functions.{name} ")
        return f'{to} {g.mark("<|constrain|>")} "json" {message} {tool_json(schema)}'

    fn = _alternatives(g, forced, header)
    return g.add("calls", f"analysis? {channel} {fn}")  # one call: <|call|> ends the turn


def _qwen3_coder(g: LarkBuilder, forced: ForcedCall, template: str) -> str:
    def function(name: str, schema: Mapping[str, Any], i: int) -> str:
        params = _xml_parameters(g, f"fn_{i}", schema)
        return f'{lark_string(f"<function={name}>")} {NL} {params} "</function>"'

    fn = _alternatives(g, forced, function)
    call = g.add("tool_call", f"{g.mark('<tool_call>')} {NL} {fn} {NL} {g.mark('</tool_call>')}")
    return _joined(g, call, forced, "\n")


_VALUE_END = "</parameter>"
# A minLength above 1 multiplies the lexer's states by maxLength; llguidance's default limits
# took it up to 256 (a text of 8 at least) and failed at 1000, so past this only "not empty" is
# kept.
_MIN_LENGTH_UP_TO = 256


def _xml_parameters(g: LarkBuilder, prefix: str, schema: Mapping[str, Any]) -> str:
    """The `<parameter=KEY>` blocks of one function, in the schema's order (or "" for none)."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for j, (key, sub) in enumerate(properties.items()):
        head = lark_string(f"<parameter={key}>\n")
        value = _xml_value(g, f"{prefix}_p{j}", sub, defs)
        rule = g.add(f"{prefix}_p{j}", f"{head} {value} {NL}")
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts) if parts else '""'


def _xml_value(g: LarkBuilder, name: str, schema: Any, defs: dict[str, Any]) -> str:
    """A value and its closing tag: raw text for strings, JSON otherwise. A text value ends at
    the first `</parameter>` (a newline before it is markup, as Qwen's parser reads it)."""
    close = lark_string("\n" + _VALUE_END)
    if not isinstance(schema, Mapping):
        schema = {}
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None and all(isinstance(c, str) for c in choices):
        return f"({' | '.join(lark_string(c) for c in choices)}) {close}"
    if "string" not in kinds:
        return f"{tool_json({**schema, **defs})} {close}"
    upper, most = name.upper(), schema.get("maxLength")
    least = schema.get("minLength", 0)
    if least > 1 and most is not None and most > _MIN_LENGTH_UP_TO:
        least = 1
    text = text_until(_VALUE_END, most, optional="\n")
    if least:  # not closed before `least` characters
        text += f" & ~/(?s:.){{0,{least - 1}}}\\n?{_regex_text(_VALUE_END)}(?s:.)*/"
    g.add(upper, text)
    return g.add(f"{name}_text", upper, lazy=True)


_FORMATS = {
    "hermes": _hermes,
    "generic": _hermes,
    "qwen3_coder": _qwen3_coder,
    "llama3_json": _llama3,
    "mistral": _mistral,
    "harmony": _harmony,
}


def forced_call_grammar(
    tokenizer,
    format_name: str,
    template: str,
    forced: ForcedCall,
    reasoning: str | None = None,
    think_chars: int = THINK_CHARS,
) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that makes the forced call(s) in the
    format `format_name` (tool_parsers.FORMATS). `reasoning`: "open" when the prompt left a think
    block open, "may" when the answer may open one, None for no think block."""
    g = LarkBuilder(tokenizer, think_chars)
    calls = _FORMATS[format_name](g, forced, template)
    if reasoning is None:
        return "start: " + calls + "\n" + g.text()
    body = g.until("think_body", "</think>")
    after = "/\\n{1,2}/?"  # Qwen3 writes </think>\n\n
    if reasoning == "open":
        return f"start: {body} {after} {calls}\n" + g.text()
    think = g.add("think", f"{g.mark('<think>')} {body} {after}")
    return f"start: {think}? {calls}\n" + g.text()
