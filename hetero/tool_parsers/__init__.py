"""Tool-call formats of model families, and how the one a model speaks is chosen.

The chat template shows the format: it writes the markers its model was trained on when it
renders tools and past calls (`<tool_call>` for Hermes/Qwen, `<function=` for Qwen3-Coder,
`[TOOL_CALLS]` for Mistral, `<|python_tag|>` and `"parameters"` for Llama 3.x, `<|channel|>` for
gpt-oss). A template that never reads `tools` gets the generic format (generic.py): the tools are
described in the system prompt and the model is asked for Hermes-style calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetero.tool_parsers.base import ToolParser
from hetero.tool_parsers.harmony import HarmonyParser
from hetero.tool_parsers.hermes import HermesParser
from hetero.tool_parsers.llama3 import Llama3JsonParser
from hetero.tool_parsers.mistral import MistralParser
from hetero.tool_parsers.qwen3_coder import Qwen3CoderParser
from hetero.tool_parsers.stream import CallDelta, Delta, ToolCall, new_call_id

__all__ = [
    "FORMATS",
    "CallDelta",
    "Delta",
    "ToolCall",
    "ToolFormat",
    "ToolParser",
    "detect_format",
    "new_call_id",
]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: type[ToolParser]
    native: bool = True  # the template renders tools and past calls itself
    special_tokens: bool = False  # the markers are control tokens: decode them as text
    id_length: int | None = None  # call ids of exactly this many letters and digits


FORMATS = {
    f.name: f
    for f in (
        ToolFormat("hermes", HermesParser),
        ToolFormat("qwen3_coder", Qwen3CoderParser),
        ToolFormat("llama3_json", Llama3JsonParser, special_tokens=True),
        ToolFormat("mistral", MistralParser, special_tokens=True, id_length=9),
        ToolFormat("harmony", HarmonyParser),
        ToolFormat("generic", HermesParser, native=False),
    )
}

_READS_TOOLS = re.compile(r"\{[{%][^}]*\btools\b")


def detect_format(template: str) -> ToolFormat:
    """The format of the model whose chat template is `template`."""
    if "<|channel|>" in template and "<|message|>" in template:
        return FORMATS["harmony"]
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_coder"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    llama = "<|start_header_id|>" in template and "parameters" in template
    if "<|python_tag|>" in template or llama:
        return FORMATS["llama3_json"]
    if _READS_TOOLS.search(template):
        return FORMATS["hermes"]  # it renders tools its own way; Hermes is the common answer
    return FORMATS["generic"]
