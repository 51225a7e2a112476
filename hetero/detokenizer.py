"""Stream text out of a token stream, one token at a time, never splitting a character.

A byte-level token often carries part of a UTF-8 character (an emoji is four bytes and is
commonly two or three tokens), and a SentencePiece stream spells such characters as `<0xNN>`
byte tokens. Each token's bytes go through an incremental UTF-8 decoder, which returns every
complete character and holds back the bytes of an unfinished one:

    token bytes    F0 9F | 98      | 80 20 61
    emitted        ""    | ""      | "😀 a"

Each step costs the token's own bytes (O(1) amortized, no re-decoding of the sequence), and the
concatenated output equals `Tokenizer.decode(all_ids)`: the same bytes, the same U+FFFD for
invalid sequences (a decoder fed piecewise replaces exactly what a one-shot decode replaces), and
the same single leading space dropped for SentencePiece vocabularies with a space prefix.

One object per stream; it holds a few bytes of state, so thousands of streams are cheap.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from hetero.tokenizer import Tokenizer

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


class IncrementalDetokenizer:
    """Turns one stream of token ids into text increments."""

    __slots__ = ("_tokenizer", "_skip_special", "_decoder", "_strip_pending")

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = _Utf8Decoder(errors="replace")
        # The leading space is dropped from the first character the stream produces.
        self._strip_pending = tokenizer.strips_leading_space

    def _emit(self, text: str) -> str:
        if self._strip_pending and text:
            self._strip_pending = False
            if text[0] == " ":
                return text[1:]
        return text

    def add(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still unfinished)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._emit(self._decoder.decode(self._tokenizer.token_bytes(token_id)))

    def add_many(self, token_ids: Iterable[int]) -> str:
        """`add` over several tokens, joined."""
        return "".join([self.add(t) for t in token_ids])

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD if the stream ended inside a character."""
        return self._emit(self._decoder.decode(b"", final=True))

    @property
    def pending_bytes(self) -> int:
        """How many bytes of an unfinished character are held back."""
        return len(self._decoder.getstate()[0])
