"""The GGUF tokenizer against independent references.

* SmolLM2 (the real file, pre-tokenizer `smollm`): ids and decoded text equal transformers'
  tokenizer loaded from the same GGUF.
* Every other byte-level pre-tokenizer: a GGUF written here with SmolLM2's (reduced, digit-extended)
  vocabulary and that `tokenizer.ggml.pre`, against a pure-Python reference (the `regex` module
  running llama.cpp's regexes, then rank-ordered BPE merges). The regexes come from transformers'
  GGUF table where it has the name (llama3, qwen2, qwen35, tekken, gpt-4o) and from llama.cpp's
  source, transcribed in this file, for the rest.
* SentencePiece (`llama`) vocabularies: a model trained here with `sentencepiece`, written to
  GGUF as llama.cpp's converter does, against sentencepiece's own encode and decode.
"""

from __future__ import annotations

import os

import gguf
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from hetero import pretokenizers
from hetero.tokenizer import FimTokens, Tokenizer
from tests.support.tokenizer_assets import (
    MULTILINGUAL,
    NOT_MERGED_WORD,
    byte_level_vocab,
    spm_metadata,
    train_spm,
    write_gguf,
)

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = [
    "",
    "Hello world",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo(Bar):\n\tpass\n",
    "if (x == 10) { y += 3; }\r\n    else {\n        z = [1, 2, 3];\n    }",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\nnewlines\n \n  \n",
    "Numbers: 1 12 123 1234 12345 123456789012345 3.14159 -42 1,000,000 0x1F",
    "I'm sure it's fine, DON'T you think? We'll see; they've gone.",
    "Accents: café naïve résumé Ångström façade — “quotes” ‘single’ …",
    "CJK: 中文分词，日本語のテキスト、한국어 문장.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "Mixed: Ελληνικά, Русский, עברית, العربية, हिन्दी",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special<|endoftext|>inside<|im_end|>text <reponame>",
    "Punctuation!!! ??? ... ;;; --- *** ((( ))) ''' \"\"\" ```python```",
    "https://example.com/path?query=1&b=2#frag user@example.org",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "e\u0301 combining, a\u00a0non-breaking, ideographic\u3000space",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ！ and µ, ℃, ™, §",
    "x" * 300 + " " + "ab" * 100,
]

PRE_TEXTS = TEXTS + MULTILINGUAL + [f"We saw {NOT_MERGED_WORD[1:]} x 12345 y", "DeepSeek ＡＢＣ！"]

# llama.cpp's regexes (src/llama-vocab.cpp), for the names transformers' GGUF table lacks.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
LLAMA_CPP_REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "olmo": [_GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "deepseek-llm": [
        r"[\r\n]",
        r"\s?[" + pretokenizers._DEEPSEEK_CASED + "]+",  # checked below against Unicode
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ],
    "deepseek-v3": [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "poro-chat": [_PORO],
    "viking": [_PORO, r"\p{N}"],
}
for _name in ("llama-bpe", "dbrx", "qwen2", "qwen35", "tekken", "gpt-4o"):
    key = "llama3" if _name == "llama-bpe" else _name
    LLAMA_CPP_REGEXES[_name] = [GGUF_PRE_TOKENIZER_SPLITS[key]]
IGNORE_MERGES = {"llama-bpe", "tekken"}


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class ReferenceBPE:
    """Independent byte-level BPE: `regex` splits, then the lowest-ranked adjacent pair merges
    first (leftmost on ties), as llama.cpp's `llm_tokenizer_bpe_session` does."""

    def __init__(self, meta: dict, regexes: list[str], ignore_merges: bool) -> None:
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {
            tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])
        }
        self.patterns = [regex.compile(r) for r in regexes]
        specials = sorted(
            (t for t, ty in zip(tokens, types, strict=True) if ty in (2, 3, 4)), key=len
        )
        self.specials = regex.compile("(" + "|".join(map(regex.escape, specials[::-1])) + ")")
        self.ignore_merges, self.b2u = ignore_merges, _gpt2_bytes_to_unicode()

    def _words(self, text: str) -> list[str]:
        words = [text] if text else []
        for pattern in self.patterns:
            cut = []
            for word in words:
                pos = 0
                for m in pattern.finditer(word):
                    cut += [word[pos : m.start()], m.group()]
                    pos = m.end()
                cut.append(word[pos:])
            words = [w for w in cut if w]
        return words

    def _bpe(self, word: str) -> list[int]:
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms = list(word)
        while True:
            pairs = [
                (self.ranks[p], i)
                for i, p in enumerate(zip(syms, syms[1:], strict=False))
                if p in self.ranks
            ]
            if not pairs:
                return [self.vocab[s] for s in syms]
            _, i = min(pairs)
            syms[i : i + 2] = [syms[i] + syms[i + 1]]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for k, part in enumerate(self.specials.split(text)):
            if k % 2:
                ids.append(self.vocab[part])
                continue
            for word in self._words(part):
                ids += self._bpe("".join(self.b2u[b] for b in word.encode()))
        return ids


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_smollm2_matches_transformers(smollm2, hf_smollm2, text):
    ids = smollm2.encode(text)
    assert ids == hf_smollm2.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert smollm2.decode(ids, skip_special=skip) == hf_smollm2.decode(
            ids, skip_special_tokens=skip
        )
    assert smollm2.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip=st.booleans())
def test_smollm2_random_ids_decode_like_transformers(smollm2, hf_smollm2, ids, skip):
    # Cut characters and stray continuation bytes become U+FFFD exactly as HF's lossy decode does.
    assert smollm2.decode(ids, skip_special=skip) == hf_smollm2.decode(
        ids, skip_special_tokens=skip
    )


def test_smollm2_isolates_every_numeric_character(smollm2):
    # llama.cpp's `smollm` cuts each \p{N} (Nd, Nl, No) apart first, as SmolLM2's own Digits
    # pre-tokenizer does. transformers' GGUF loader knows no `smollm` and keeps " ½" together.
    assert [smollm2.decode([i]) for i in smollm2.encode("a ½")] == ["a", " ", "½"]


def test_smollm2_vocabulary(smollm2):
    tok = smollm2
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pre) == (49152, 1, 2, "smollm")
    assert tok.model_type == "gpt2" and not tok.add_bos and not tok.add_eos
    # <|endoftext|>, <|im_end|> and (llama.cpp's FIM repo marker) <reponame> end generation.
    assert tok.eos_ids == {0, 2, 4} and tok.fim == FimTokens(repo=4)
    assert tok.encode("hi", add_special=True) == tok.encode("hi")
    assert tok.token_bytes(tok.token_to_id("Ġ")) == b" "
    assert tok.token_bytes(tok.token_to_id("Ċ")) == b"\n"
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("no such token") is None
    assert tok.is_special(0) and not tok.is_special(tok.token_to_id("Ġ"))
    assert "<|im_start|>" in tok.chat_template
    assert tok.encode_batch(TEXTS[:4]) == [tok.encode(t) for t in TEXTS[:4]]


@pytest.fixture(scope="module")
def byte_meta(smollm2_path) -> dict:
    return byte_level_vocab(smollm2_path)


def _byte_tok(byte_meta, tmp_path, pre: str, **extra) -> Tokenizer:
    meta = {**byte_meta, "tokenizer.ggml.pre": pre, **extra}
    return Tokenizer.from_gguf(write_gguf(tmp_path / f"{pre}.gguf", meta))


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_pre_tokenizer_matches_reference(byte_meta, tmp_path, pre):
    tok = _byte_tok(byte_meta, tmp_path, pre)
    reference = ReferenceBPE(byte_meta, LLAMA_CPP_REGEXES[pre], pre in IGNORE_MERGES)
    for text in PRE_TEXTS:
        assert tok.encode(text) == reference.encode(text), (pre, text)
        assert tok.decode(tok.encode(text)) == text


def test_deepseek_cased_letters_are_cased_letters():
    import unicodedata

    letters = regex.compile("[" + pretokenizers._DEEPSEEK_CASED + "]")
    members = [c for c in map(chr, range(0x20000)) if letters.fullmatch(c)]
    assert len(members) > 2500
    assert {unicodedata.category(c) for c in members} == {"Lu", "Ll", "Lt"}


def test_reader_and_path_give_the_same_tokenizer(byte_meta, tmp_path):
    path = write_gguf(tmp_path / "v.gguf", {**byte_meta, "tokenizer.ggml.pre": "qwen2"})
    from_reader, from_path = Tokenizer.from_gguf(gguf.GGUFReader(path)), Tokenizer.from_gguf(path)
    assert from_reader.pre == from_path.pre == "qwen2"
    for text in TEXTS:
        assert from_reader.encode(text) == from_path.encode(text)


def test_digit_rules_differ_by_family(byte_meta, tmp_path):
    def pieces(pre: str) -> list[str]:
        tok = _byte_tok(byte_meta, tmp_path, pre)
        return [tok.decode([i]) for i in tok.encode("x 12345")]

    assert pieces("llama-bpe") == ["x", " ", "123", "45"]  # \p{N}{1,3}
    assert pieces("qwen2") == ["x", " ", "1", "2", "3", "4", "5"]  # \p{N}
    assert pieces("smollm") == ["x", " ", "1", "2", "3", "4", "5"]  # \p{N} split first
    assert pieces("gpt-2")[1].startswith(" 1")  # ` ?\p{N}+` keeps the space on the run
    assert pieces("default")[1:3] == [" ", "123"]  # [0-9]{3} cut after ` ?\p{N}+`


def test_ignore_merges_vocabularies_emit_known_words_whole(byte_meta, tmp_path):
    word_id = byte_meta["tokenizer.ggml.tokens"].index(NOT_MERGED_WORD)
    assert _byte_tok(byte_meta, tmp_path, "llama-bpe").encode(" zyzzyva") == [word_id]
    assert len(_byte_tok(byte_meta, tmp_path, "gpt-2").encode(" zyzzyva")) > 1


def test_llama3_defaults_add_bos(byte_meta, tmp_path):
    tok = _byte_tok(byte_meta, tmp_path, "llama-bpe")
    assert tok.add_bos and tok.encode("Hi", add_special=True) == [1, *tok.encode("Hi")]
    off = _byte_tok(byte_meta, tmp_path, "llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    assert off.encode("Hi", add_special=True) == off.encode("Hi")
    eos = _byte_tok(byte_meta, tmp_path, "qwen2", **{"tokenizer.ggml.add_eos_token": True})
    assert eos.encode("Hi", add_special=True) == [*eos.encode("Hi"), 2]


def test_end_and_fim_tokens_found_by_metadata_and_text(byte_meta, tmp_path):
    extra = ["<|eot_id|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]
    n = len(byte_meta["tokenizer.ggml.tokens"])
    meta = {
        **byte_meta,
        "tokenizer.ggml.tokens": byte_meta["tokenizer.ggml.tokens"] + extra,
        "tokenizer.ggml.token_type": byte_meta["tokenizer.ggml.token_type"] + [1] * len(extra),
        "tokenizer.ggml.fim_mid_token_id": 5,  # metadata wins over the text
        "tokenizer.ggml.eom_token_id": 7,
    }
    tok = _byte_tok(meta, tmp_path, "llama-bpe")
    assert tok.fim == FimTokens(prefix=n + 1, suffix=n + 2, middle=5, repo=4, sep=n + 4)
    assert {2, n, n + 4, 7} <= tok.eos_ids
    # Found by its text, <|eot_id|> becomes control (llama.cpp does the same): matched whole.
    assert tok.encode("a<|eot_id|>") == [*tok.encode("a"), n] and tok.is_special(n)


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"])
def test_pre_tokenizer_matches_transformers(byte_meta, tmp_path, pre):
    from transformers import AutoTokenizer

    tok = _byte_tok(byte_meta, tmp_path, pre)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=f"{pre}.gguf")
    # transformers builds these BPEs without llama.cpp's ignore_merges; switch it on.
    hf.backend_tokenizer.model.ignore_merges = pre in IGNORE_MERGES
    for text in PRE_TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), (pre, text)


# -- SentencePiece -----------------------------------------------------------------------------

SPM_TEXTS = (
    [t for t in TEXTS if "<|" not in t and "<rep" not in t]
    + MULTILINGUAL
    + [
        "Unseen characters fall back to bytes: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ ⚡ 🦀 鬱",
        " one leading space",
        "  two leading spaces and a trailing one ",
    ]
)


@pytest.fixture(scope="module")
def sp():
    return train_spm()


@pytest.fixture(scope="module")
def spm_tok(sp, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return Tokenizer.from_gguf(write_gguf(path, spm_metadata(sp)))


@pytest.mark.parametrize("text", SPM_TEXTS, ids=range(len(SPM_TEXTS)))
def test_spm_matches_sentencepiece(sp, spm_tok, text):
    ids = spm_tok.encode(text)
    assert ids == sp.encode(text)
    assert spm_tok.decode(ids) == sp.decode(ids) == text
    assert spm_tok.encode(text, add_special=True) == [sp.bos_id(), *ids]


def test_spm_byte_fallback_and_special_tokens(sp, spm_tok):
    ids = spm_tok.encode("☃")
    assert [spm_tok.id_to_token(i) for i in ids][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert b"".join(spm_tok.token_bytes(i) for i in ids) == " ☃".encode()
    # llama.cpp puts a space prefix on the text after every special token.
    assert spm_tok.encode("<s>Hi</s>there") == [1, *sp.encode("Hi"), 2, *sp.encode("there")]
    assert spm_tok.decode(spm_tok.encode("<s>Hi</s>"), skip_special=True) == "Hi"
    assert (spm_tok.bos_id, spm_tok.eos_id, spm_tok.eos_ids) == (1, 2, {2})
    assert spm_tok.strips_leading_space and spm_tok.pre is None


def test_spm_without_space_prefix(sp, spm_tok, tmp_path):
    meta = {**spm_metadata(sp), "tokenizer.ggml.add_space_prefix": False}
    bare = Tokenizer.from_gguf(write_gguf(tmp_path / "bare.gguf", meta))
    for text in filter(None, SPM_TEXTS):  # "" gets no prefix, " " would get one
        assert bare.encode(" " + text) == spm_tok.encode(text)
        assert bare.decode(bare.encode(text)) == text


# -- refusals -----------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_lists_known_ones(byte_meta, tmp_path):
    with pytest.raises(ValueError, match=r"unknown pre-tokenizer 'nonesuch'.*llama-bpe.*qwen2"):
        _byte_tok(byte_meta, tmp_path, "nonesuch")


def test_bad_files_are_refused(byte_meta, tmp_path):
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        Tokenizer({**byte_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer({"general.architecture": "llama"})
    with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
        Tokenizer({**byte_meta, "tokenizer.ggml.merges": []})
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, really")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_bad_input_is_refused(smollm2):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2.decode([1, 49152])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2.token_bytes(-1)
    with pytest.raises(TypeError):
        smollm2.encode(b"bytes")
