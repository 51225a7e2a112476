"""A working byte-level BPE vocabulary for synthetic models, trained in about a second.

Synthetic GGUF files (see `hetero.synth`) have random weights, but the tokenizer must be real:
the server, the chat template and the incremental detokenizer all run on it. We train BPE merges
with the `tokenizers` BpeTrainer on a bounded sample of the Python standard library's own source
(present on every machine that runs us), using the same pre-tokenizer regex that the declared
`tokenizer.ggml.pre` means to llama.cpp, so every consumer splits text the way we trained it.

Vocabulary layout (ids):

    [0, n_bpe)                 256 byte symbols + trained merges, NORMAL
    [n_bpe, n_bpe + 9)         <|endoftext|> <|im_start|> <|im_end|> and the FIM tokens, CONTROL
    [n_bpe + 9, n_bpe + 9 + k) a chat family's own tokens (synth_chat.py), CONTROL or USER_DEFINED
    [.., vocab_size)           <|reserved_special_token_i|>, CONTROL (pads to the model's rows)
"""

from __future__ import annotations

import functools
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFWriter, Keys, TokenType
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hetero.pretokenizers import pre_tokenizer_spec
from hetero.synth_chat import ChatFamily

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre` name. Several
# patterns apply one after another, each splitting the pieces the previous one left.
PRE_TOKENIZER_PATTERNS: dict[str, tuple[str, ...]] = {
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "smollm": (
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "tekken": pre_tokenizer_spec("tekken").regexes,  # Mistral Nemo's
}

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
FIM_PAD, REPO_NAME, FILE_SEP = "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    FIM_PREFIX,
    FIM_MIDDLE,
    FIM_SUFFIX,
    FIM_PAD,
    REPO_NAME,
    FILE_SEP,
)

# ChatML, as Qwen and SmolLM2 use it; `add_generation_prompt` opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Bounds that keep training near a second on a 2-core machine: ~3 MB of text, at most 16k
# trained tokens (the rest of a 128k vocabulary is reserved control tokens).
MAX_TRAIN_CHARS = 3_000_000
MAX_TRAINED_TOKENS = 16_000
MIN_TRAIN_CHARS = 100_000


@dataclass(frozen=True)
class SynthVocab:
    """A complete gpt2-style vocabulary: tokens, their types, merges, and special ids."""

    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]  # "left right", the GGUF spelling
    n_trained: int  # ids below this are byte symbols or merges
    specials: tuple[str, ...] = SPECIAL_TOKENS  # from id n_trained on
    chat: ChatFamily | None = None

    def token_id(self, text: str) -> int:
        return self.n_trained + self.specials.index(text)


def training_text(seed: int = 0, max_chars: int = MAX_TRAIN_CHARS) -> list[str]:
    """A bounded, seed-ordered sample of the standard library's `*.py` sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    random.Random(seed).shuffle(files)
    texts: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    if total < MIN_TRAIN_CHARS:
        raise RuntimeError(
            f"found only {total} characters of Python source under {root}; "
            "the synthetic tokenizer trains on the standard library's .py files"
        )
    return texts


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in PRE_TOKENIZER_PATTERNS[pre]
    ]
    # The regexes do the splitting; ByteLevel only maps bytes to the gpt2 printable alphabet.
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


@functools.lru_cache(maxsize=8)
def _train(pre: str, n_tokens: int, seed: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Train BPE to at most `n_tokens`; returns (tokens by id, merges). Cached per process."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_text(seed), trainer)
    vocab = tokenizer.get_vocab()
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("BPE trainer produced non-contiguous token ids")
    merges = tuple(f"{a} {b}" for a, b in _merges_of(tokenizer))
    return tokens, merges


def _merges_of(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    raw = json.loads(tokenizer.to_str())["model"]["merges"]
    # tokenizers >= 0.20 stores merges as pairs; older releases as "a b" strings.
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in raw]


def build_vocab(
    vocab_size: int, pre: str, seed: int = 0, chat: ChatFamily | None = None
) -> SynthVocab:
    """A vocabulary of exactly `vocab_size` tokens (the embedding's row count); with `chat`, its
    special tokens too, and its pre-tokenizer."""
    if chat is not None:
        pre = chat.pre
    if pre not in PRE_TOKENIZER_PATTERNS:
        known = ", ".join(sorted(PRE_TOKENIZER_PATTERNS))
        raise ValueError(f"unknown pre-tokenizer {pre!r}; known: {known}")
    specials = (
        SPECIAL_TOKENS + tuple(t for t in chat.specials if t not in SPECIAL_TOKENS)
        if chat
        else SPECIAL_TOKENS
    )
    n_special = len(specials)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} < {256 + n_special} (256 bytes + specials)")
    trained, merges = _train(pre, min(vocab_size - n_special, MAX_TRAINED_TOKENS), seed)
    n_reserved = vocab_size - len(trained) - n_special
    reserved = tuple(f"<|reserved_special_token_{i}|>" for i in range(n_reserved))
    tokens = trained + specials + reserved
    user = set(chat.user_defined) if chat else set()
    kinds = [TokenType.USER_DEFINED if t in user else TokenType.CONTROL for t in specials]
    types = (int(TokenType.NORMAL),) * len(trained) + tuple(int(k) for k in kinds)
    types += (int(TokenType.CONTROL),) * n_reserved
    return SynthVocab(pre, tokens, types, merges, len(trained), specials, chat)


def add_vocab_metadata(writer: GGUFWriter, vocab: SynthVocab) -> None:
    """Write the `tokenizer.*` keys llama.cpp and `hetero.tokenizer` read."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    chat = vocab.chat
    bos, eos = (chat.bos, chat.eos) if chat else (ENDOFTEXT, IM_END)
    writer.add_bos_token_id(vocab.token_id(bos))
    writer.add_eos_token_id(vocab.token_id(eos))
    writer.add_eot_token_id(vocab.token_id(eos))
    writer.add_pad_token_id(vocab.token_id(ENDOFTEXT))
    writer.add_add_bos_token(chat.add_bos if chat else False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat.template if chat else CHATML_TEMPLATE)
    # GGUFWriter has no helpers for the FIM ids; the keys are llama.cpp's.
    fim = {
        Keys.Tokenizer.FIM_PRE_ID: FIM_PREFIX,
        Keys.Tokenizer.FIM_SUF_ID: FIM_SUFFIX,
        Keys.Tokenizer.FIM_MID_ID: FIM_MIDDLE,
        Keys.Tokenizer.FIM_PAD_ID: FIM_PAD,
        Keys.Tokenizer.FIM_REP_ID: REPO_NAME,
        Keys.Tokenizer.FIM_SEP_ID: FILE_SEP,
    }
    for key, text in fim.items():
        writer.add_uint32(key, vocab.token_id(text))
