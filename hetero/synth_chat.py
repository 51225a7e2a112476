"""Chat families for synthetic models: a real model's chat template and the special tokens its
vocabulary has (`hetero synth --chat qwen3`).

With one, a random-weight model speaks the chat format of the family it imitates: its template
renders tools and past calls as the real model's does, its control tokens (Llama's headers,
Mistral's `[TOOL_CALLS]`) are single tokens of the right type, and the tool-call format the
server picks for it is the real model's. The templates in `synth_templates/` are the models' own
`chat_template` from their tokenizer_config.json:

    qwen2.5        Qwen2.5-7B-Instruct
    qwen3          Qwen3-0.6B (thinks in <think>; `enable_thinking`)
    llama3.1       Llama-3.1-8B-Instruct
    mistral-nemo   Mistral-Nemo-Instruct-2407 ([TOOL_CALLS], 9-character call ids)

As in the real files, Qwen's `<tool_call>` and `<think>` tags are user-defined tokens (decoded as
text), Llama's and Mistral's markers control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class ChatFamily:
    name: str
    template_file: str
    pre: str  # the pre-tokenizer of the family's vocabulary
    bos: str
    eos: str
    add_bos: bool = False
    control: tuple[str, ...] = ()  # beside the synthetic vocabulary's ChatML and FIM tokens
    user_defined: tuple[str, ...] = ()

    @property
    def template(self) -> str:
        return resources.files("hetero").joinpath("synth_templates", self.template_file).read_text()

    @property
    def specials(self) -> tuple[str, ...]:
        return self.control + self.user_defined


_QWEN_TAGS = ("<tool_call>", "</tool_call>")
CHAT_FAMILIES: dict[str, ChatFamily] = {
    f.name: f
    for f in (
        ChatFamily(
            "qwen2.5", "qwen2.5.jinja", "qwen2", "<|endoftext|>", "<|im_end|>",
            user_defined=_QWEN_TAGS,
        ),
        ChatFamily(
            "qwen3", "qwen3.jinja", "qwen2", "<|endoftext|>", "<|im_end|>",
            user_defined=(*_QWEN_TAGS, "<think>", "</think>", "<tool_response>",
                          "</tool_response>"),
        ),
        ChatFamily(
            "llama3.1", "llama3.1.jinja", "llama-bpe", "<|begin_of_text|>", "<|eot_id|>",
            add_bos=True,
            control=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                     "<|finetune_right_pad_id|>"),
        ),
        ChatFamily(
            "mistral-nemo", "mistral-nemo.jinja", "tekken", "<s>", "</s>", add_bos=True,
            control=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"),
        ),
    )
}  # fmt: skip


def get_family(name: str) -> ChatFamily:
    if name not in CHAT_FAMILIES:
        raise ValueError(f"unknown chat family {name!r}; known: {', '.join(CHAT_FAMILIES)}")
    return CHAT_FAMILIES[name]
