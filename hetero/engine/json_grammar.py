"""A byte-level pushdown automaton for one JSON object (RFC 8259), for constrained decoding.

It reads UTF-8 bytes, not characters, because byte-level BPE tokens may end inside a character:
JSON's structure is ASCII and every byte >= 0x80 belongs to a string, so bytes are enough, and a
small count of pending continuation bytes keeps strings valid UTF-8.

A state is a hashable tuple `(mode, aux, stack)`:
  mode   what the next byte may be (the constants below)
  aux    a small counter whose meaning depends on the mode: the length of the current whitespace
         run, the UTF-8 continuation bytes a string still owes (and their range), the hex digits
         a \\u escape still owes, the length of a number so far, or which literal
         (true/false/null) and how far into it
  stack  the open containers as a str of '{' and '[' (innermost last)

`step(state, byte)` returns the next state, or None when the byte cannot continue any JSON object
within the limits. The limits keep a model from rambling inside the grammar: whitespace runs are
at most `max_ws` bytes, containers nest at most `max_depth` deep, numbers are at most
`max_number` bytes. The top level is one object; once it closes the state is DONE, which accepts
nothing (the request stops there).
"""

from __future__ import annotations

from dataclasses import dataclass

State = tuple[int, int, str]

# Modes where whitespace may come (aux = length of the current whitespace run).
START, OBJ_OPEN, OBJ_KEY, COLON, VALUE, ARR_OPEN, AFTER = range(7)
# Strings: aux = UTF-8 continuation bytes still owed. Key strings end in COLON, values in AFTER.
STR_KEY, STR_VAL = 7, 8
ESC_KEY, ESC_VAL = 9, 10  # after a backslash
HEX_KEY, HEX_VAL = 11, 12  # inside \uXXXX: aux = hex digits still owed
# Numbers (aux = bytes so far): after '-', after a leading 0, integer digits, after '.',
# fraction digits, after 'e', after the exponent's sign, exponent digits.
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(13, 21)
LITERAL = 21  # aux = 8 * which literal + bytes of it already read
DONE = 22

WS_MODES = frozenset((START, OBJ_OPEN, OBJ_KEY, COLON, VALUE, ARR_OPEN, AFTER))
STRING_MODES = frozenset((STR_KEY, STR_VAL))
_NUMBER_ENDS = frozenset((N_ZERO, N_INT, N_FRAC, N_EXP))  # a number may end in these

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
# UTF-8 (RFC 3629): a lead byte -> aux = continuation bytes owed + 4 * the range its first
# continuation byte must fall in (the ranges that rule out overlong forms, surrogates and code
# points past U+10FFFF); later continuation bytes take range 0.
_CONTINUATION = ((0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F))
_UTF8_LEADS = {b: 1 for b in range(0xC2, 0xE0)}
_UTF8_LEADS.update({b: 2 for b in range(0xE1, 0xF0)})
_UTF8_LEADS.update({0xE0: 2 + 4 * 1, 0xED: 2 + 4 * 2, 0xF0: 3 + 4 * 3, 0xF4: 3 + 4 * 4})
_UTF8_LEADS.update({b: 3 for b in (0xF1, 0xF2, 0xF3)})
# Where a digit leads from each number mode that takes one (N_MINUS is special-cased).
_DIGIT_NEXT = {
    N_INT: N_INT,
    N_DOT: N_FRAC,
    N_FRAC: N_FRAC,
    N_E: N_EXP,
    N_ESIGN: N_EXP,
    N_EXP: N_EXP,
}
_LITERALS = (b"true", b"false", b"null")
_LITERAL_OF = {lit[0]: i for i, lit in enumerate(_LITERALS)}


@dataclass(frozen=True)
class JsonLimits:
    """Bounds that keep generation inside the grammar finite in its idle parts."""

    max_ws: int = 16  # longest whitespace run between tokens of the grammar
    max_depth: int = 16  # deepest nesting of objects and arrays
    max_number: int = 32  # longest number, in bytes

    def __post_init__(self) -> None:
        for name in ("max_ws", "max_depth", "max_number"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"JsonLimits.{name} must be an integer >= 1, got {value!r}")


INITIAL: State = (START, 0, "")


class JsonAutomaton:
    """The transition function under a set of limits (stateless: states are plain tuples)."""

    def __init__(self, limits: JsonLimits | None = None) -> None:
        self.limits = limits or JsonLimits()

    def step(self, state: State, b: int) -> State | None:
        mode, aux, stack = state
        if mode in STRING_MODES:
            return self._string(mode, aux, stack, b)
        if mode in WS_MODES:
            if b in _WS:
                return (mode, aux + 1, stack) if aux < self.limits.max_ws else None
            return self._structural(mode, stack, b)
        if mode >= N_MINUS and mode <= N_EXP:
            return self._number(mode, aux, stack, b)
        if mode == LITERAL:
            word, pos = _LITERALS[aux >> 3], aux & 7
            if b != word[pos]:
                return None
            return (AFTER, 0, stack) if pos + 1 == len(word) else (LITERAL, aux + 1, stack)
        if mode == ESC_KEY or mode == ESC_VAL:
            string = STR_KEY if mode == ESC_KEY else STR_VAL
            if b in _ESCAPES:
                return (string, 0, stack)
            return (mode + 2, 4, stack) if b == 0x75 else None  # 'u': four hex digits follow
        if mode == HEX_KEY or mode == HEX_VAL:
            if b not in _HEX:
                return None
            string = STR_KEY if mode == HEX_KEY else STR_VAL
            return (string, 0, stack) if aux == 1 else (mode, aux - 1, stack)
        return None  # DONE accepts nothing

    def accepts(self, state: State, data: bytes) -> State | None:
        """The state after all of `data`, or None if some byte is refused."""
        s: State | None = state
        for b in data:
            s = self.step(s, b)
            if s is None:
                return None
        return s

    # -- the parts of step ----------------------------------------------------------------------

    def _structural(self, mode: int, stack: str, b: int) -> State | None:
        """A non-whitespace byte in a mode between tokens of the grammar."""
        if mode == START:
            return self._open(stack, b) if b == 0x7B else None  # the top level is an object
        if mode == OBJ_OPEN or mode == OBJ_KEY:
            if b == 0x22:
                return (STR_KEY, 0, stack)
            return self._close(stack, b) if mode == OBJ_OPEN else None
        if mode == COLON:
            return (VALUE, 0, stack) if b == 0x3A else None
        if mode == VALUE or mode == ARR_OPEN:
            s = self._value(stack, b)
            return s if s is not None or mode == VALUE else self._close(stack, b)
        # AFTER a value inside a container: a comma, or the container's end
        if b == 0x2C:
            return (OBJ_KEY if stack[-1] == "{" else VALUE, 0, stack)
        return self._close(stack, b)

    def _value(self, stack: str, b: int) -> State | None:
        if b == 0x22:
            return (STR_VAL, 0, stack)
        if b == 0x7B or b == 0x5B:
            return self._open(stack, b)
        if b == 0x2D:
            return (N_MINUS, 1, stack)
        if b == 0x30:
            return (N_ZERO, 1, stack)
        if b in _DIGITS:
            return (N_INT, 1, stack)
        word = _LITERAL_OF.get(b)
        return None if word is None else (LITERAL, 8 * word + 1, stack)

    def _open(self, stack: str, b: int) -> State | None:
        if len(stack) >= self.limits.max_depth:
            return None
        return (OBJ_OPEN, 0, stack + "{") if b == 0x7B else (ARR_OPEN, 0, stack + "[")

    def _close(self, stack: str, b: int) -> State | None:
        if not stack or b != (0x7D if stack[-1] == "{" else 0x5D):
            return None
        rest = stack[:-1]
        return (AFTER, 0, rest) if rest else (DONE, 0, rest)

    def _string(self, mode: int, aux: int, stack: str, b: int) -> State | None:
        if aux:  # inside a multi-byte UTF-8 character: only (the allowed) continuation bytes
            low, high = _CONTINUATION[aux >> 2]
            return (mode, (aux & 3) - 1, stack) if low <= b <= high else None
        if b == 0x22:
            return (COLON if mode == STR_KEY else AFTER, 0, stack)
        if b == 0x5C:
            return (mode + 2, 0, stack)
        if b < 0x20:
            return None  # JSON strings hold no raw control characters
        if b < 0x80:
            return (mode, 0, stack)
        return (mode, _UTF8_LEADS[b], stack) if b in _UTF8_LEADS else None

    def _number(self, mode: int, n: int, stack: str, b: int) -> State | None:
        if b in _DIGITS:
            if n >= self.limits.max_number:
                return None
            if mode == N_MINUS:
                return (N_ZERO if b == 0x30 else N_INT, n + 1, stack)
            to = _DIGIT_NEXT.get(mode)  # N_ZERO: no digit may follow a leading zero
            return None if to is None else (to, n + 1, stack)
        if n < self.limits.max_number:
            if b == 0x2E and (mode == N_ZERO or mode == N_INT):
                return (N_DOT, n + 1, stack)
            if (b == 0x65 or b == 0x45) and mode in (N_ZERO, N_INT, N_FRAC):
                return (N_E, n + 1, stack)
            if (b == 0x2B or b == 0x2D) and mode == N_E:
                return (N_ESIGN, n + 1, stack)
        if mode not in _NUMBER_ENDS:
            return None
        return self.step((AFTER, 0, stack), b)  # the number ended; this byte follows it


def is_done(state: State) -> bool:
    return state[0] == DONE
