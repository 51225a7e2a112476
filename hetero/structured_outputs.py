r"""Structured outputs: what a request's output must match (vLLM's `StructuredOutputsParams`).

A request carries at most one constraint, in `SamplingParams.structured_outputs`, with exactly one
of these fields set:

    json         a JSON Schema (a dict, or its JSON text): the output is one JSON value matching
                 it (types, properties in the schema's order, required, enum, const, anyOf,
                 arrays with items/prefixItems/minItems/maxItems, nested objects,
                 additionalProperties, string minLength/maxLength/pattern/format, number
                 minimum/maximum/exclusive bounds, $ref/$defs)
    json_object  True: the output is one JSON object, any keys
    regex        the output matches this regular expression (Rust `regex` syntax), whole
    choice       the output is exactly one of these strings
    grammar      a grammar in llguidance's Lark dialect (llama.cpp's GBNF is converted)

The engine compiles it with llguidance (engine/grammar_mask.py) into a token mask per step, one
matcher per sequence: n > 1 gives each sequence its own, speculation skips constrained rows, and
a pipeline's last stage receives the masks with the step. When the grammar can take no more
bytes (a JSON object closed, the last rule of a Lark grammar done) the request ends there with
finish_reason "stop"; where the grammar may end or go on (`start: call+`), end-of-sequence tokens
are allowed exactly when it may end.

Lark in llguidance (docs/syntax.md of llguidance): `start:` is the top rule; strings are byte
sequences the model may spell with any tokens; `%json {schema}` is a JSON Schema inline;
`<|im_end|>` names a control token (control tokens never match text); `/regex/` a lexeme.
`json_rule(schema)` and `lark_string(text)` write those pieces. A forced tool call in the
Hermes format (Qwen2.5, Qwen3), a choice among functions, and parallel calls:

    def call(name, params):  # {"name": ..., "arguments": ...}, in this order
        return json_rule({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })

    open_, close = lark_string("<tool_call>\n"), lark_string("\n</tool_call>")
    grammar = f'''
    start: tool_call ("\\n" tool_call)*
    tool_call: {open_} (get_weather | get_time) {close}
    get_weather: {call("get_weather", weather_params)}
    get_time: {call("get_time", time_params)}
    '''
    SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar))

`start: tool_call` alone is one call; `(get_weather | get_time)` is the choice among functions
(one name: a named tool_choice). `<tool_call>` is an ordinary added token in Qwen's vocabulary:
the string matches it, or its spelling. JSON written by `json_rule` keeps this module's
whitespace bound (JSON_OPTIONS), as `json` and `json_object` do: a weak model cannot fill its
answer with blank lines between two tokens of the JSON.

`check()` compiles the grammar without a vocabulary and raises ValueError with llguidance's
message: the server calls it so that a bad schema is a 400, not a failed request.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

# Whitespace between JSON tokens: at most 16 bytes in a run (the old JSON mask's bound), so a
# pretty-printed answer fits and a rambling one cannot pad forever (llguidance's default is any).
JSON_OPTIONS = {
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,16}",
    "json_allow_general_unicode_escapes": True,
}
_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one field set); see the module docstring."""

    json: dict | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}")
        choice = self.choice
        if choice is not None and (not choice or not all(isinstance(c, str) for c in choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise ValueError("structured_outputs.json must be a JSON Schema (an object or text)")

    @functools.cached_property
    def key(self) -> str:
        """The llguidance grammar (its serialized form): what the engine compiles and caches
        (kept once made: a large schema takes milliseconds, and `check` made it already)."""
        return _serialize(self)

    def check(self) -> None:
        """Compile the grammar (no vocabulary needed); ValueError with the reason if it fails."""
        LLMatcher = require_llguidance().LLMatcher
        try:
            grammar = self.key
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid structured output: {e}") from e
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"invalid structured output: {error.strip()}")


def require_llguidance():
    """The llguidance module, or ValueError saying how to get it (a request's refusal, where an
    install lacks the package: everything else in hetero runs without it)."""
    try:
        import llguidance
    except ImportError as e:
        raise ValueError(
            f"structured outputs need the llguidance package, which is not installed ({e}); "
            "pip install llguidance"
        ) from e
    return llguidance


def _serialize(p: StructuredOutputsParams) -> str:
    llguidance = require_llguidance()
    LLMatcher, grammar_from = llguidance.LLMatcher, llguidance.grammar_from

    if p.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if p.json is not None:
        schema = json.loads(p.json) if isinstance(p.json, str) else p.json
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(lark_string, p.choice)))
    return grammar_from("grammar", p.grammar)  # Lark, or GBNF converted to it


def lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def json_rule(schema: dict[str, Any] | bool) -> str:
    """`%json {...}`: a JSON value matching `schema` inside a Lark grammar, with JSON_OPTIONS
    (the schema's own "x-guidance" options win)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema)
