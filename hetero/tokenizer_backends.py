"""Build a `tokenizers` (HF, Rust) tokenizer equal to llama.cpp's for a GGUF vocabulary.

Two vocabulary kinds, named by `tokenizer.ggml.model`:

* `gpt2`: byte-level BPE. Each byte of the UTF-8 text is spelled as one printable character
  (GPT-2's table: 0x21..0x7E, 0xA1..0xAC, 0xAE..0xFF stand for themselves, the other 68 bytes
  move to U+0100..U+0143, so a space is "Ġ"), the text is cut by the pre-tokenizer regexes, and the
  ranked merges of `tokenizer.ggml.merges` join characters into tokens.
* `llama`: SentencePiece BPE. Spaces become "▁" (U+2581), one "▁" is prepended to every stretch of
  text that starts the input or follows a special token (llama.cpp's `is_prev_special`), and pieces
  merge best-score-first. Characters outside the vocabulary fall back to `<0xNN>` byte tokens.
  GGUF stores scores rather than merges, so the merges are recovered from the vocabulary.

Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Types 2, 3 and 4 are matched whole in the raw text before any splitting, as
llama.cpp's `tokenizer_st_partition` does; 2 and 3 are special (dropped by `skip_special`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hetero.pretokenizers import PreTokenizerSpec

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)
MATCHED_WHOLE_TYPES = frozenset({TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED})
SPECIAL_TYPES = frozenset({TOKEN_UNKNOWN, TOKEN_CONTROL})

SPM_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (see the module docstring)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in table)
    table.update({b: chr(0x100 + i) for i, b in enumerate(moved)})
    return table


@cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def token_pieces(tokens: Sequence[str], types: Sequence[int], byte_level: bool) -> list[bytes]:
    """The raw bytes each token stands for when decoded.

    Special and user-defined tokens are stored pre-normalised (raw text) by llama.cpp's converter,
    so they decode to their text. Byte tokens `<0xNN>` decode to the byte. Normal tokens undo the
    vocabulary's spelling: GPT-2 characters back to bytes (a token with a character outside the
    table passes through as UTF-8, as HF's ByteLevel decoder does), or "▁" back to a space.
    """
    to_byte = unicode_to_byte()
    pieces: list[bytes] = []
    for text, ttype in zip(tokens, types, strict=True):
        if ttype in MATCHED_WHOLE_TYPES:
            pieces.append(text.encode())
        elif ttype == TOKEN_BYTE and (m := _BYTE_PIECE.fullmatch(text)):
            pieces.append(bytes([int(m.group(1), 16)]))
        elif byte_level:
            try:
                pieces.append(bytes(to_byte[c] for c in text))
            except KeyError:
                pieces.append(text.encode())
        else:
            pieces.append(text.replace(SPM_SPACE, " ").encode())
    return pieces


def _vocab_dict(tokens: Sequence[str], spelled: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, key in enumerate(spelled):
        if key in vocab:
            # llama.cpp refuses such a file too: two ids for one text cannot both be reachable.
            raise ValueError(
                f"duplicate token in vocabulary: {tokens[i]!r} has ids {vocab[key]} and {i}"
            )
        vocab[key] = i
    return vocab


def _split_merges(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`"a b"` -> `("a", "b")`, split at the first space after position 0 as llama.cpp does.

    Merges naming a piece (or a result) outside the vocabulary can never fire; dropping them keeps
    the Rust BPE builder, which rejects them, from refusing an otherwise usable file.
    """
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        left, right = merge[:cut], merge[cut + 1 :]
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    return pairs


def _add_whole_tokens(backend: HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Register the tokens matched whole in raw text (types 2, 3, 4) with their own ids."""
    ids = [i for i, ttype in enumerate(types) if ttype in MATCHED_WHOLE_TYPES]
    whole = [
        AddedToken(tokens[i], special=types[i] in SPECIAL_TYPES, normalized=False) for i in ids
    ]
    backend.add_tokens(whole)
    for i in ids:
        # Their texts are keys of the model vocabulary, so the added vocabulary reuses those ids;
        # anything else would hand the model ids it was never trained on.
        if backend.token_to_id(tokens[i]) != i:
            raise ValueError(f"token {tokens[i]!r} (id {i}) did not keep its id")


def build_byte_level(
    tokens: Sequence[str],
    types: Sequence[int],
    merges: Sequence[str],
    spec: PreTokenizerSpec,
) -> HFTokenizer:
    """Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with llama.cpp's pre-tokenizer `spec`."""
    alphabet = set(byte_to_unicode().values())
    to_unicode = byte_to_unicode()
    # Normal tokens are spelled in the byte alphabet already; a stray one that is not gets
    # re-spelled (as HF does) so merges can still reach it. Whole-matched tokens keep raw text.
    spelled = [
        text
        if ttype in MATCHED_WHOLE_TYPES or set(text) <= alphabet
        else "".join(to_unicode[b] for b in text.encode())
        for text, ttype in zip(tokens, types, strict=True)
    ]
    vocab = _vocab_dict(tokens, spelled)
    model = models.BPE(
        vocab=vocab, merges=_split_merges(merges, vocab), ignore_merges=spec.ignore_merges
    )
    backend = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    _add_whole_tokens(backend, tokens, types)
    return backend


def spm_merges(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary, best first.

    Every way to cut a mergeable piece into two pieces of the vocabulary is a merge ranked by the
    whole piece's score (llama.cpp merges the adjacent pair whose concatenation scores highest).
    Equal scores put the longer left part first: of two overlapping candidates producing the same
    piece, llama.cpp takes the leftmost, which is the one with the longer left part. This is the
    order HF's `generate_merges` uses for GGUF llama vocabularies too.
    """
    mergeable = {TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED}
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty in mergeable}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, index in vocab.items():
        local = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((scores[index], len(left), len(right), left, right) for left, right in local)
    # Stable sort on the key only, so the per-piece order above survives among full ties.
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def build_spm(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float],
    merges: Sequence[str] | None,
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model = "llama"`) with byte fallback."""
    vocab = _vocab_dict(tokens, tokens)
    pairs = _split_merges(merges, vocab) if merges else spm_merges(tokens, types, scores)
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = HFTokenizer(model)
    # The normalizer runs on each stretch of text between whole-matched tokens, so Prepend gives
    # exactly llama.cpp's "space prefix at the start and after every special token".
    escape = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape])
        if add_space_prefix
        else escape
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    _add_whole_tokens(backend, tokens, types)
    return backend
