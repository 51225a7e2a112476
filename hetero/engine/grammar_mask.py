"""Token masks for structured outputs: which vocabulary entries may come next, per sequence.

llguidance does the work: an Earley parser over the grammar's lexemes, with the token trie and a
lexer derived from the grammar, computes one step's mask in tens to hundreds of microseconds on
49k and 150k vocabularies (BENCHMARKS.md, benchmarks/grammar_mask.py), without a precompiled
automaton per schema. Here we give it the vocabulary and keep one matcher per constrained
sequence.

The vocabulary (`grammar_vocab`): each token's bytes as it decodes; control tokens (the
tokenizer's special ids) as 0xFF + their name, llguidance's mark for tokens that never match
text but that a grammar may name (`<|im_end|>`); rows of the logits past the vocabulary as empty
tokens, never allowed. End-of-sequence ids are the tokenizer's: a grammar that may end allows
them, one that has ended allows only them (and the engine stops the request before that).

Masks are packed bits, [B, ceil(W / 32)] int32, bit j of word i for token 32 i + j (W: the
logits' width): 32 times smaller than a bool mask to copy to the device or to ship to a
pipeline's last stage; the sampler unpacks them there (sampling_filters.unpack_allowed).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hetero.sampling import SamplingParams
from hetero.structured_outputs import require_llguidance

log = logging.getLogger("hetero.engine")
MATCHER_CACHE = 64  # compiled grammars kept (IDE clients send the same schemas on every request)
# Masks go to llguidance's thread pool from this many rows, on machines with cores to spare: a
# mask takes tens of microseconds, and on 2 busy cores the pool's hand-off measured slower than
# 64 rows in turn (BENCHMARKS.md).
PARALLEL_ROWS = 32
PARALLEL_CORES = 8


def grammar_vocab(tokenizer, width: int):
    """The llguidance tokenizer of a hetero Tokenizer, `width` tokens wide (~0.3 s for 49k)."""
    llguidance = require_llguidance()

    special = tokenizer.special_ids
    n = min(width, tokenizer.vocab_size)  # a vocabulary wider than the logits: the rest is moot
    tokens = [
        b"\xff" + tokenizer.id_to_token(i).encode() if i in special else tokenizer.token_bytes(i)
        for i in range(n)
    ]
    tokens += [b""] * (width - n)
    eos = sorted(i for i in tokenizer.eos_ids if i < width) or [0]

    class Wrapper:  # the duck type llguidance.TokenizerWrapper reads
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_id
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, data: bytes | str) -> list[int]:
            text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
            return tokenizer.encode(text, parse_special=False)

    wrapped = llguidance.TokenizerWrapper(Wrapper())
    return llguidance.LLTokenizer(wrapped, n_vocab=width, eos_token=eos)


class Constraints:
    """The engine's constrained sequences, by request id (the vocabulary is built on first use,
    or by `prepare`)."""

    def __init__(self, tokenizer, width: int) -> None:
        self._tokenizer = tokenizer
        self.width = width
        self.words = -(-width // 32)
        self._vocab = None
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> a fresh matcher
        self._active: dict[str, object] = {}
        self._executor = None
        self._missing: ValueError | None = None  # why llguidance could not be loaded

    def prepare(self):
        """Build the llguidance vocabulary now, not at the first constrained request, where it
        would pause every running sequence. Without llguidance installed this logs why and the
        engine serves the rest; constrained requests are then refused (ValueError)."""
        if self._vocab is None:
            try:
                self._vocab = grammar_vocab(self._tokenizer, self.width)
            except ValueError as e:
                if self._missing is None:
                    log.warning("%s", e)
                self._missing = e
                raise
        return self._vocab

    def warm(self) -> None:
        """`prepare`, where a missing llguidance is only logged (engine start)."""
        try:
            self.prepare()
        except ValueError:
            pass

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Start a matcher for the request's constraint (none: nothing); ValueError when the
        grammar does not compile."""
        so = params.structured_outputs
        if so is not None:
            self._active[request_id] = self._matcher(so.key)

    def _matcher(self, grammar: str):
        LLMatcher = require_llguidance().LLMatcher
        fresh = self._compiled.get(grammar)
        if fresh is None:
            fresh = LLMatcher(self.prepare(), grammar, log_level=0)
            if fresh.is_error():
                raise ValueError(f"invalid structured output: {fresh.get_error()}")
            self._compiled[grammar] = fresh
            if len(self._compiled) > MATCHER_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return fresh.deep_copy()

    def drop(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._active

    def masks(
        self, request_ids: Sequence[str], parallel: bool | None = None
    ) -> torch.Tensor | None:
        """[B, words] int32 packed masks of the rows (all bits set on unconstrained rows), or
        None when no row is constrained. `parallel`: on the thread pool or not (None: the rule
        above)."""
        if not self._active:
            return None
        rows = [(m, i) for i, r in enumerate(request_ids) if (m := self._active.get(r)) is not None]
        if not rows:
            return None
        out = torch.full((len(request_ids), self.words), -1, dtype=torch.int32)
        if parallel is None:
            parallel = len(rows) >= PARALLEL_ROWS and (os.cpu_count() or 1) >= PARALLEL_CORES
        if not parallel:
            for m, i in rows:
                m.unsafe_compute_mask_ptr(out[i].data_ptr(), self.words * 4)
        else:
            self._pool().unsafe_compute_mask_ptr(rows, out.data_ptr(), self.words * 4, len(out))
        return out

    def _pool(self):
        if self._executor is None:
            self._executor = require_llguidance().LLExecutor()
        return self._executor

    def accept(self, request_id: str, token_id: int) -> bool:
        """Feed a sampled token; True when the request must stop: its grammar can take no more
        (or, which a correct mask rules out, the token broke it: logged, never raised, so one
        request cannot take the engine thread down)."""
        m = self._active.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token_id):
            log.error("request %s: %s; stopping it", request_id, m.get_error())
            return True
        return m.is_stopped()
