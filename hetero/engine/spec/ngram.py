"""N-gram proposals: guess the next tokens of a sequence from where its last n tokens occurred.

Prompt lookup (as in vLLM's "[ngram]" speculator and llama.cpp's lookup decoding): when the last n
tokens of a sequence occurred earlier in it, the tokens that followed them then are a good guess
for what follows now: code edits, refactors and quotes copy long runs of their prompt.

    sequence   ... a b c d e f ... x y  a b c | ?        last n = 3 tokens: "a b c"
                       ^^^^^ match       ^^^^^            propose "d e f ..." (up to k tokens)

Two sources, tried in order:
  - the request's own prompt and output (NgramIndex, built incrementally: each step adds only the
    n-grams that end at the new tokens);
  - a rolling cache across the engine's finished requests (NgramCache, bounded, least recently
    used out first): code repeats itself across a team's requests.
Longer matches are tried first (n from max_n down to min_n): they predict better.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one growing sequence last occurred.

    maps[n][gram] = the position right after the gram's latest occurrence. Only grams ending
    before the last token are indexed (`extend` stops one short), so the sequence's own suffix
    never matches itself and a hit always has at least one token after it.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # grams ending at positions < indexed are in the maps

    def extend(self, ids: Sequence[int]) -> None:
        """Index the grams of ids that end before its last token (ids only ever grows)."""
        upto = len(ids) - 1
        if upto <= self.indexed:
            return
        lo = max(0, self.indexed - self.max_n + 1)
        window = list(ids[lo:upto])  # the tokens the new grams are made of
        for end in range(self.indexed, upto):  # the gram ends at position `end` (inclusive)
            for n, grams in self.maps.items():
                if end + 1 >= n:
                    grams[tuple(window[end + 1 - n - lo : end + 1 - lo])] = end + 1
        self.indexed = upto

    def lookup(self, ids: Sequence[int], k: int, min_n: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of ids' suffix."""
        for n in range(self.max_n, max(min_n, self.min_n) - 1, -1):
            if len(ids) < n:
                continue
            pos = self.maps[n].get(tuple(ids[len(ids) - n :]))
            if pos is not None:
                return list(ids[pos : pos + k])
        return []


class NgramCache:
    """Continuations of n-grams seen in finished requests, across the whole engine.

    gram -> the up to `width` tokens that followed its latest occurrence. Bounded at `capacity`
    grams, the least recently used (looked up or stored) going first.
    """

    def __init__(
        self, min_n: int, max_n: int, width: int, capacity: int = 200_000, pending: int = 64
    ) -> None:
        if capacity < 1:
            raise ValueError(f"n-gram cache capacity must be >= 1, got {capacity}")
        self.min_n, self.max_n, self.width, self.capacity = min_n, max_n, width, capacity
        self._grams: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        # Sequences not indexed yet. Indexing one costs ~1-2 ms of Python for a 500-token request;
        # paid at the next lookup instead of when the request ends, it is not paid at all while
        # nothing guesses ("auto" with a full batch), and only the latest `pending` are kept.
        self._pending: deque[list[int]] = deque(maxlen=pending)

    def __len__(self) -> int:
        self._index_pending()
        return len(self._grams)

    def add(self, ids: Sequence[int]) -> None:
        """Remember the grams of a whole sequence (a finished request's prompt and output),
        indexed at the next lookup."""
        self._pending.append(list(ids))

    def _index_pending(self) -> None:
        while self._pending:
            self._index(self._pending.popleft())

    def _index(self, ids: list[int]) -> None:
        grams = self._grams
        for pos in range(self.min_n, len(ids)):  # the tokens from `pos` on follow each gram
            follow = tuple(ids[pos : pos + self.width])
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                gram = tuple(ids[pos - n : pos])
                grams[gram] = follow
                grams.move_to_end(gram)
        while len(grams) > self.capacity:
            grams.popitem(last=False)

    def lookup(self, ids: Sequence[int], k: int, min_n: int) -> list[int]:
        self._index_pending()
        for n in range(self.max_n, max(min_n, self.min_n) - 1, -1):
            if len(ids) < n:
                continue
            gram = tuple(ids[len(ids) - n :])
            follow = self._grams.get(gram)
            if follow is not None:
                self._grams.move_to_end(gram)
                return list(follow[:k])
        return []
