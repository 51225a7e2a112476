"""Pre-tokenizer regexes for byte-level BPE vocabularies, by the name in `tokenizer.ggml.pre`.

A byte-level BPE vocabulary only reproduces its training if the text is cut into the same words
first. llama.cpp (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`) keys these splits by the name the
converter wrote; each entry here carries llama.cpp's regex list verbatim. The regexes run in order,
each one cutting every piece the previous ones left, keeping both the matches and the text between
them (HF `Split(behavior="isolated")` is that operation).

Two deviations, both towards the model's own `tokenizer.json`: llama.cpp spells `tekken` and
`gpt-4o` with a lookahead workaround because its regex engine lacks `\\p{Lu}`/`\\p{Ll}`; Oniguruma
has them, so those use the original patterns that llama.cpp quotes in its comments.

Digits differ by family and are the most common way to get a vocabulary subtly wrong:
`\\p{N}{1,3}` (llama3, gpt-4o) groups up to three, `\\p{N}` (qwen2, starcoder, tekken) isolates
each one, ` ?\\p{N}+` (gpt-2) keeps a run whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp cuts text for one family of BPE vocabularies."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is emitted whole (llama3, tekken)
    add_bos: bool = False  # llama.cpp's default for tokenizer.ggml.add_bos_token when absent


# Contractions spelled case-insensitively without `(?i:)`, as llama.cpp adapts them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek LLM's "cased letter" class. Written with escapes: several members (U+1F7D, U+1FBE,
# U+1FD3, U+1FDB, U+2126, U+212A) have canonical equivalents elsewhere, and an editor that
# normalises the file would silently turn a range like U+1F5F-U+1F7D into a reversed one.
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# CJK unified ideographs, U+0800..U+4E00 (as DeepSeek wrote it) and Hangul syllables.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_CASED + "]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)

_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")

_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

_BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)

_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_MINICPM5_WORDS = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_FAMILIES: list[tuple[tuple[str, ...], PreTokenizerSpec]] = [
    (
        ("default",),
        PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    ),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), PreTokenizerSpec((_LLAMA3,))),
    (("deepseek-llm",), PreTokenizerSpec(_DEEPSEEK_LLM)),
    (("deepseek-coder",), PreTokenizerSpec(_DEEPSEEK_CODER)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizerSpec(_DEEPSEEK3)),
    (
        ("falcon",),
        PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ),
    (
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        PreTokenizerSpec((r"\p{N}", _GPT2)),
    ),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        PreTokenizerSpec((_GPT2,)),
    ),
    (
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        PreTokenizerSpec((_QWEN2,)),
    ),
    (("qwen35",), PreTokenizerSpec((_QWEN35,))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizerSpec((_PORO,))),
    (("viking",), PreTokenizerSpec((_PORO, r"\p{N}"))),
    (("tekken",), PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizerSpec((_GPT4O,))),
    (("seed-coder",), PreTokenizerSpec((_SEED_CODER,))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizerSpec((_BAILING,))),
    (("minicpm5",), PreTokenizerSpec((r"\p{N}{1,3}", _MINICPM5_WORDS), ignore_merges=True)),
]

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    name: spec for names, spec in _FAMILIES for name in names
}


def pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` name; a missing name means llama.cpp's `default`."""
    if name is None or name == "":
        return PRE_TOKENIZERS["default"]
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ValueError(
            f"unknown pre-tokenizer {name!r} (tokenizer.ggml.pre); known: {known}"
        ) from None
