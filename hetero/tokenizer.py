"""The tokenizer a GGUF file describes, built from its metadata (never from a model hub).

    tok = Tokenizer.from_gguf("model.gguf")
    ids = tok.encode("<|im_start|>user\\nHi", add_special=True)
    text = tok.decode(ids, skip_special=True)

Encoding follows llama.cpp (`src/llama-vocab.cpp`), which is what GGUF files are made for: the
same vocabulary kinds (see `tokenizer_backends`), pre-tokenizers (see `pretokenizers`), BOS/EOS
defaults, and the same by-text detection of end-of-generation and fill-in-the-middle tokens for
files whose metadata does not name them. Special tokens written in the text always encode to
their ids, as HF tokenizers do.

Decoding is defined on bytes: the pieces of the ids (`token_bytes`) are concatenated and decoded
as UTF-8 with U+FFFD for invalid sequences; a SentencePiece vocabulary with a space prefix then
drops one leading space. `IncrementalDetokenizer` streams exactly this text.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import Tokenizer as HFTokenizer

from hetero.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat
from hetero.pretokenizers import pre_tokenizer_spec
from hetero.tokenizer_backends import (
    SPECIAL_TYPES,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    build_byte_level,
    build_spm,
    token_pieces,
)
from hetero.tokenizer_metadata import read_tokenizer_metadata

_K = "tokenizer.ggml."

# Texts llama.cpp treats as end-of-generation in any vocabulary (`special_eog_ids`).
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "[e~[",
)

# Fill-in-the-middle roles: metadata keys (new, then deprecated) and llama.cpp's fallback texts.
_FIM_KEYS = {
    "prefix": ("fim_pre_token_id", "prefix_token_id"),
    "suffix": ("fim_suf_token_id", "suffix_token_id"),
    "middle": ("fim_mid_token_id", "middle_token_id"),
    "pad": ("fim_pad_token_id",),
    "repo": ("fim_rep_token_id",),
    "sep": ("fim_sep_token_id",),
}
_FIM_TEXTS = {
    "prefix": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suffix": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "middle": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# gpt-oss channel markers must stay visible in decoded text (llama.cpp makes them user-defined).
_ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class FimTokens:
    """Fill-in-the-middle token ids; None where the vocabulary has no such token."""

    prefix: int | None = None
    suffix: int | None = None
    middle: int | None = None
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Thread-safe; build once per model."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        """Build from GGUF metadata (the `tokenizer.*` keys); most callers use `from_gguf`."""
        self._meta = dict(metadata)
        self.model_type: str = self._meta.get(_K + "model") or ""
        if not self.model_type:
            raise ValueError("the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        if self.model_type not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported tokenizer model {self.model_type!r} (tokenizer.ggml.model); "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )
        self._tokens, self._types = self._read_vocab()
        self._token_ids = {t: i for i, t in enumerate(self._tokens)}
        self.pre: str | None = self._meta.get(_K + "pre") if self.model_type == "gpt2" else None
        self._read_special_ids()
        self.fim = self._find_fim()
        self.eos_ids = self._find_eos_ids()
        for text in _ALWAYS_SHOWN:
            if (i := self._token_ids.get(text)) is not None:
                self._types[i] = TOKEN_USER_DEFINED
        self._backend = self._build_backend()
        self._pieces = token_pieces(self._tokens, self._types, self.model_type == "gpt2")
        named = (self.bos_id, self.eos_id, self._unk_id)
        self.special_ids = frozenset(
            {i for i, t in enumerate(self._types) if t in SPECIAL_TYPES}
            | {i for i in named if i is not None}
        )
        # The vocabulary now lives in the backend and the tables above; keep the small keys only.
        self._meta = {k: v for k, v in self._meta.items() if not isinstance(v, list)}

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """Build from a GGUF file path, or from an already open `gguf.GGUFReader`."""
        return cls(read_tokenizer_metadata(source))

    # -- building ---------------------------------------------------------------------------

    def _read_vocab(self) -> tuple[list[str], list[int]]:
        tokens = self._meta.get(_K + "tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("the GGUF metadata has no token list (tokenizer.ggml.tokens)")
        # llama.cpp names empty tokens the same way, so they stay addressable.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = self._meta.get(_K + "token_type")
        if types is None:
            types = [TOKEN_NORMAL] * len(tokens)
        if len(types) < len(tokens):
            raise ValueError(f"token_type has {len(types)} entries for {len(tokens)} tokens")
        return tokens, [int(t) for t in types[: len(tokens)]]

    def _id(self, key: str, default: int | None = None) -> int | None:
        value = self._meta.get(_K + key, default)
        if value is None or not 0 <= int(value) < len(self._tokens):
            return None  # llama.cpp ignores out-of-range ids too
        return int(value)

    def _read_special_ids(self) -> None:
        spm = self.model_type == "llama"
        # llama.cpp's defaults for SentencePiece files that do not say (LLaMA's 1, 2 and 0).
        self.bos_id: int | None = self._id("bos_token_id", 1 if spm else None)
        self.eos_id: int | None = self._id("eos_token_id", 2 if spm else None)
        self._unk_id = self._id("unknown_token_id", 0 if spm else None)
        default_bos = True if spm else pre_tokenizer_spec(self.pre).add_bos
        self.add_bos: bool = bool(self._meta.get(_K + "add_bos_token", default_bos))
        self.add_eos: bool = bool(self._meta.get(_K + "add_eos_token", False))
        self._space_prefix = spm and bool(self._meta.get(_K + "add_space_prefix", True))
        for flag, token_id, name in (
            (self.add_bos, self.bos_id, "bos"),
            (self.add_eos, self.eos_id, "eos"),
        ):
            if flag and token_id is None:
                raise ValueError(f"add_{name}_token is set but the vocabulary has no {name} token")

    def _mark_control(self, token_id: int) -> None:
        # Like llama.cpp: a token found by its end/FIM text is control even if mislabelled, so it
        # is matched whole in text and left out by `skip_special`.
        self._types[token_id] = TOKEN_CONTROL

    def _find_fim(self) -> FimTokens:
        found: dict[str, int | None] = {}
        for role, keys in _FIM_KEYS.items():
            ids = (self._id(key) for key in keys)
            by_key = next((i for i in ids if i is not None), None)
            texts = (self._token_ids.get(text) for text in _FIM_TEXTS[role])
            by_text = next((i for i in texts if i is not None), None)
            if by_key is None and by_text is not None:
                self._mark_control(by_text)
            found[role] = by_key if by_key is not None else by_text
        return FimTokens(**found)

    def _find_eos_ids(self) -> frozenset[int]:
        ids = {self.eos_id, self._id("eot_token_id"), self._id("eom_token_id")}
        ids |= {self.fim.pad, self.fim.repo, self.fim.sep}
        for text in _EOG_TEXTS:
            if (i := self._token_ids.get(text)) is not None:
                self._mark_control(i)
                ids.add(i)
        has = self._token_ids.__contains__
        # llama.cpp's workarounds: in gpt-oss/solar-open `<|end|>` closes a message, not the
        # turn; with gemma4's `<|tool_response>` present, `</s>` is an ordinary token.
        harmony = has("<|return|>") and has("<|call|>")
        if (harmony or (has("<|calls|>") and has("<|flush|>"))) and has("<|end|>"):
            ids.discard(end := self._token_ids["<|end|>"])
            self._types[end] = TOKEN_USER_DEFINED
        if has("<|tool_response>") and has("</s>"):
            ids.discard(eos := self._token_ids["</s>"])
            self._types[eos] = TOKEN_NORMAL
        return frozenset(i for i in ids if i is not None)

    def _build_backend(self) -> HFTokenizer:
        if self.model_type == "gpt2":
            merges = self._meta.get(_K + "merges")
            if not merges:
                raise ValueError("a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges")
            spec = pre_tokenizer_spec(self.pre)
            return build_byte_level(self._tokens, self._types, merges, spec)
        scores = self._meta.get(_K + "scores")
        if scores is None or len(scores) < len(self._tokens):
            raise ValueError("a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores")
        merges = self._meta.get(_K + "merges")
        return build_spm(
            self._tokens, self._types, scores, merges, self._unk_id, self._space_prefix
        )

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template(self) -> str | None:
        return self._meta.get("tokenizer.chat_template") or None

    @property
    def strips_leading_space(self) -> bool:
        """Whether decoding drops one leading space (SentencePiece with a space prefix)."""
        return self._space_prefix

    def _check_id(self, i: int) -> int:
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is outside the vocabulary (size {len(self._tokens)})")
        return i

    def id_to_token(self, i: int) -> str:
        """The token's text as the GGUF file spells it (byte-level or `▁` form)."""
        return self._tokens[self._check_id(i)]

    def token_to_id(self, token: str) -> int | None:
        return self._token_ids.get(token)

    def token_type(self, i: int) -> int:
        """The llama.cpp token type (1 normal .. 6 byte), after llama.cpp's by-text fixes."""
        return self._types[self._check_id(i)]

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for in decoded text."""
        return self._pieces[self._check_id(i)]

    def is_special(self, i: int) -> bool:
        """Control and unknown tokens (and BOS/EOS): what `skip_special` leaves out."""
        return i in self.special_ids

    # -- text -------------------------------------------------------------------------------

    def _with_special(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids for `text`; `add_special` adds BOS/EOS as the metadata says.
        parse_special=False: control tokens' text in `text` (a user's file that contains
        "<|fim_middle|>") is encoded as plain text, never as the control token (llama.cpp's
        `parse_special` off)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        backend = self._backend if parse_special else self._plain_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        return self._with_special(ids) if add_special else ids

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        """The backend with its special tokens' texts matched as plain text."""
        plain = HFTokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_batch(self, texts: Sequence[str], add_special: bool = False) -> list[list[int]]:
        """`encode` over many texts, in parallel on the Rust side."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch() takes a sequence of str")
        out = [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self._with_special(ids) for ids in out] if add_special else out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        pieces, special = self._pieces, self.special_ids
        data = b"".join(
            pieces[self._check_id(int(i))] for i in ids if not (skip_special and int(i) in special)
        )
        text = data.decode("utf-8", errors="replace")
        if self._space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    # -- chat -------------------------------------------------------------------------------

    def _text_of(self, token_id: int | None) -> str:
        return self._tokens[token_id] if token_id is not None else ""

    def template_for(self, tools: Any) -> str:
        """The template `apply_chat_template` renders with these tools (a `tool_use` template
        where the file has one and tools are given)."""
        named = self._meta.get("tokenizer.chat_template.tool_use")
        if tools and named:
            return named
        if self.chat_template:
            return self.chat_template
        if "<|im_start|>" in self._token_ids:
            return CHATML_TEMPLATE
        raise ChatTemplateError(
            "this model has no chat template (tokenizer.chat_template is missing and the "
            "vocabulary has no <|im_start|> for a ChatML default); send a plain completion instead"
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The prompt text for `messages` (see `hetero.chat_template.render_chat`).

        `chat_template=` overrides the model's template; BOS/EOS texts default to the model's.
        """
        template = kw.pop("chat_template", None) or self.template_for(kw.get("tools"))
        kw.setdefault("bos_token", self._text_of(self.bos_id))
        kw.setdefault("eos_token", self._text_of(self.eos_id))
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **kw)
