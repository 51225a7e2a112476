"""Token masks for JSON-constrained decoding: which vocabulary entries may come next.

Built once per vocabulary (`JsonVocab`): each token's bytes (special tokens have none: they are
never JSON), and a byte trie of them. A state's mask is found by walking the trie with the
automaton (json_grammar.py) and pruning every subtree whose prefix it refuses, as llama.cpp's
grammar sampler and outlines do; outside strings almost all of the vocabulary dies at its first
byte or two.

Inside a string the automaton refuses almost nothing, so the walk would visit the whole trie.
There, tokens made only of plain string bytes (no quote, backslash, control byte or broken UTF-8)
are allowed in every string state and are a precomputed mask; only the few tokens holding a quote
or a backslash are walked, from that byte on, in a second trie of those suffixes.

Masks are cached per automaton state (LRU): a string's content, a run of digits or the same
position in a repeated structure reuse one mask, so most steps cost a dictionary lookup.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hetero.engine.json_grammar import (
    INITIAL,
    STR_VAL,
    STRING_MODES,
    JsonAutomaton,
    JsonLimits,
    State,
    is_done,
)

log = logging.getLogger("hetero.engine")


class _Trie:
    """A byte trie over token byte strings: node 0 is the root."""

    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[list[int] | None] = [None]  # token ids ending at each node

    def add(self, data: bytes, token_id: int) -> None:
        node = 0
        for b in data:
            nxt = self.children[node].get(b)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][b] = nxt
                self.children.append({})
                self.ends.append(None)
            node = nxt
        ids = self.ends[node]
        if ids is None:
            self.ends[node] = [token_id]
        else:
            ids.append(token_id)

    def walk(self, automaton: JsonAutomaton, state: State, node: int = 0) -> list[int]:
        """Ids of every token the automaton accepts whole from `state`, below `node`."""
        step, children, ends = automaton.step, self.children, self.ends
        out: list[int] = []
        todo = [(node, state)]
        while todo:
            node, s = todo.pop()
            for b, child in children[node].items():
                s2 = step(s, b)
                if s2 is None:
                    continue
                ids = ends[child]
                if ids is not None:
                    out.extend(ids)
                if children[child]:
                    todo.append((child, s2))
        return out


class JsonVocab:
    """A vocabulary's token bytes and tries, and the mask cache shared by all JSON requests.

    `pieces[i]`: the bytes token i stands for, or None for tokens that never appear in JSON text
    (control tokens, empty ones). `width` is the logits' width (it may exceed the vocabulary).
    """

    def __init__(
        self,
        pieces: Sequence[bytes | None],
        width: int,
        eos_ids: Iterable[int] = (),
        limits: JsonLimits | None = None,
        cache_size: int = 512,
    ) -> None:
        if width < len(pieces):
            raise ValueError(f"width {width} is smaller than the vocabulary ({len(pieces)})")
        self.automaton = JsonAutomaton(limits)
        self.width = width
        self.pieces = list(pieces)
        self.eos_ids = sorted(set(eos_ids))
        self.cache_size = cache_size
        self._cache: OrderedDict[State, np.ndarray] = OrderedDict()
        self._trie = _Trie()
        self._special = _Trie()  # suffixes from the first quote/backslash, of string tokens
        # The same split of the tokens' bytes after their first byte, by first byte: for states
        # whose first byte opens a string or ends an escape (`"`, the last hex digit of \u).
        self._plain_after: dict[int, list[int]] = {}
        self._special_after: dict[int, _Trie] = {}
        plain: list[int] = []
        for i, data in enumerate(self.pieces):
            if not data:
                continue
            self._trie.add(data, i)
            k = self._plain_prefix(data)
            if k == len(data):
                plain.append(i)
            elif k >= 0:
                self._special.add(data[k:], i)
            if len(data) > 1:
                self._split_after_first(data, i)
        # numpy, not torch: a torch fill of [V] may wake the intra-op thread pool (ms each)
        self._plain = np.zeros(width, dtype=np.bool_)
        self._plain[plain] = True

    @classmethod
    def from_tokenizer(cls, tokenizer, width: int, limits: JsonLimits | None = None) -> JsonVocab:
        special = tokenizer.special_ids
        pieces = [
            None if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)
        ]
        return cls(pieces, width, tokenizer.eos_ids, limits)

    def _split_after_first(self, data: bytes, token_id: int) -> None:
        k = self._plain_prefix(data[1:])
        if k == len(data) - 1:
            self._plain_after.setdefault(data[0], []).append(token_id)
        elif k >= 0:
            self._special_after.setdefault(data[0], _Trie()).add(data[1 + k :], token_id)

    def _plain_prefix(self, data: bytes) -> int:
        """Bytes of `data` read inside a string before a quote or backslash (len: none came);
        -1 when the bytes cannot be in a string at all (control bytes, broken UTF-8)."""
        s: State | None = (STR_VAL, 0, "{")  # a string's inside: plain bytes leave it as it is
        for k, b in enumerate(data):
            if s[1] == 0 and (b == 0x22 or b == 0x5C):  # type: ignore[index]
                return k
            s = self.automaton.step(s, b)  # type: ignore[arg-type]
            if s is None:
                return -1
        return len(data)

    def mask(self, state: State) -> np.ndarray:
        """[width] bool: the tokens allowed from `state` (EOS only once the object is done).

        The array is the cache's own: read it, never write it."""
        m = self._cache.get(state)
        if m is not None:
            self._cache.move_to_end(state)
            return m
        if is_done(state):
            m = np.zeros(self.width, dtype=np.bool_)
            m[self.eos_ids] = True
        elif state[0] in STRING_MODES and state[1] == 0:
            m = self._plain.copy()
            m[self._special.walk(self.automaton, state)] = True
        else:
            m = np.zeros(self.width, dtype=np.bool_)
            m[self._walk(state)] = True
        self._cache[state] = m
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return m

    def _walk(self, state: State) -> list[int]:
        """The trie walk, where a first byte that lands inside a string takes the shortcut."""
        trie, step = self._trie, self.automaton.step
        out: list[int] = []
        for b, child in trie.children[0].items():
            s = step(state, b)
            if s is None:
                continue
            out.extend(trie.ends[child] or ())
            if s[0] in STRING_MODES and s[1] == 0:
                out.extend(self._plain_after.get(b, ()))
                special = self._special_after.get(b)
                if special is not None:
                    out.extend(special.walk(self.automaton, s))
            elif trie.children[child]:
                out.extend(trie.walk(self.automaton, s, child))
        return out

    def advance(self, state: State, token_id: int) -> State:
        """The state after token `token_id` (ValueError if the grammar refuses it)."""
        data = self.pieces[token_id] if 0 <= token_id < len(self.pieces) else None
        nxt = None if not data else self.automaton.accepts(state, data)
        if nxt is None:
            raise ValueError(f"token {token_id} ({data!r}) cannot continue the JSON object")
        return nxt


class JsonConstraint:
    """One sequence's place in the grammar."""

    __slots__ = ("vocab", "state")

    def __init__(self, vocab: JsonVocab) -> None:
        self.vocab = vocab
        self.state: State = INITIAL

    def mask(self) -> np.ndarray:
        return self.vocab.mask(self.state)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; True once the object is complete."""
        self.state = self.vocab.advance(self.state, token_id)
        return is_done(self.state)


class Constraints:
    """The engine's constrained sequences, by request id (the vocabulary is built on first use)."""

    def __init__(self, tokenizer, width: int) -> None:
        self._tokenizer = tokenizer
        self._width = width
        self._vocab: JsonVocab | None = None
        self._active: dict[str, JsonConstraint] = {}

    def prepare(self) -> JsonVocab:
        """Build the vocabulary's tries now (~0.5 s for 49k tokens), not at the first JSON
        request, where it would pause every running sequence."""
        if self._vocab is None:
            self._vocab = JsonVocab.from_tokenizer(self._tokenizer, self._width)
        return self._vocab

    def add(self, request_id: str, params) -> None:
        if getattr(params, "json_object", False):
            self._active[request_id] = JsonConstraint(self.prepare())

    def drop(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._active

    def masks(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """[B, width] bool, the allowed tokens of each row (all of them on unconstrained rows),
        or None when no row is constrained."""
        if not self._active:
            return None
        rows = [self._active.get(r) for r in request_ids]
        if all(c is None for c in rows):
            return None
        out = np.ones((len(rows), self._width), dtype=np.bool_)
        for i, c in enumerate(rows):
            if c is not None:
                out[i] = c.mask()
        return torch.from_numpy(out)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Feed a sampled token; True when the request must stop: its object is complete (or,
        which a correct mask rules out, the token broke the grammar: logged, never raised, so
        one request cannot take the engine thread down)."""
        c = self._active.get(request_id)
        if c is None:
            return False
        try:
            return c.accept(token_id)
        except ValueError as e:
            log.error("request %s: %s; stopping it", request_id, e)
            return True
