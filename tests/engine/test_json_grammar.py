"""The JSON automaton against Python's json module: it accepts what json.dumps writes (within
its limits), refuses what json.loads refuses, and every byte path it allows ends in an object."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.engine.json_grammar import DONE, INITIAL, JsonAutomaton, JsonLimits, is_done

A = JsonAutomaton()

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**15), 10**15)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
objects = st.dictionaries(st.text(max_size=8), values, max_size=5)


def run(data: bytes, automaton: JsonAutomaton = A):
    """The state after data, and how many bytes were read when it hit DONE (None: never)."""
    s = INITIAL
    for k, b in enumerate(data):
        s = automaton.step(s, b)
        if s is None:
            return None, k
        if is_done(s):
            return s, k + 1
    return s, None


@settings(max_examples=150, deadline=None)
@given(objects, st.booleans(), st.sampled_from([None, 0, 2]))
def test_accepts_what_json_dumps_writes(obj, ascii_only, indent):
    text = json.dumps(obj, ensure_ascii=ascii_only, indent=indent)
    data = text.encode()
    state, done_at = run(data)
    assert state is not None and state[0] == DONE, text
    assert done_at == len(data)  # complete exactly at the last byte, not before


@pytest.mark.parametrize(
    "text",
    [
        '{"a":01}',  # leading zero
        '{"a":1,}',  # trailing comma
        "{a:1}",  # unquoted key
        '{"a" 1}',
        '{"a":tru}',
        '{"a":"x\ny"}',  # raw control character in a string
        '{"a":"\\x"}',  # unknown escape
        '{"a":"\\u12G4"}',
        '{"a":[1 2]}',
        '{"a":-}',
        '{"a":1.}',
        '{"a":1e}',
        '{"a":.5}',
        '{"a":}',
        '{"a":[}',
        '{"a":{]}',
        '{"a":1}}',
    ],
)
def test_refuses_invalid_json(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    state, done_at = run(text.encode())
    accepted_whole = state is not None and is_done(state) and done_at == len(text)
    assert not accepted_whole


def test_top_level_is_an_object():
    for text in ("[]", '"a"', "1", "null", " {}"):
        state, _ = run(text.encode())
        assert (state is not None and is_done(state)) == (text == " {}")


def test_refuses_broken_utf8_in_strings():
    for data in (
        b'{"a":"\x80"}',
        b'{"a":"\xc3"}',
        b'{"a":"\xe2\x82"}',
        b'{"\xff":1}',
        b'{"a":"\xe0\x80\x80"}',
        b'{"a":"\xed\xa0\x80"}',
    ):
        assert run(data)[0] is None


def test_limits():
    tight = JsonAutomaton(JsonLimits(max_ws=2, max_depth=2, max_number=4))
    assert run(b'{  "a":  1}', tight)[0][0] == DONE
    assert run(b'{   "a":1}', tight)[0] is None  # three spaces in a row
    assert run(b'{"a":{"b":1}}', tight)[0][0] == DONE
    assert run(b'{"a":{"b":[1]}}', tight)[0] is None  # depth 3
    assert run(b'{"a":1234}', tight)[0][0] == DONE
    assert run(b'{"a":12345}', tight)[0] is None
    with pytest.raises(ValueError, match="max_ws"):
        JsonLimits(max_ws=0)


def random_walk(rng: random.Random, automaton: JsonAutomaton, max_bytes: int) -> bytes | None:
    """Random accepted bytes from INITIAL until DONE (None: over max_bytes). At each state at
    least one byte must be accepted: the automaton never leaves a sequence with no way on."""
    s, out = INITIAL, bytearray()
    # Favour structure over string content so walks close within max_bytes.
    prefer = list(b'}]"}],:0') + list(range(256))
    while not is_done(s):
        options = [(b, n) for b in range(256) if (n := automaton.step(s, b)) is not None]
        assert options, f"dead end at {s} after {bytes(out)!r}"
        closing = [o for o in options if o[0] in prefer[:8]]
        b, s = rng.choice(closing if closing and rng.random() < 0.3 else options)
        out.append(b)
        if len(out) > max_bytes:
            return None
    return bytes(out)


def test_every_accepted_path_loads_as_an_object():
    rng = random.Random(0)
    automaton = JsonAutomaton(JsonLimits(max_ws=3, max_depth=4, max_number=8))
    done = 0
    for _ in range(300):
        data = random_walk(rng, automaton, 400)
        if data is None:
            continue
        assert isinstance(json.loads(data.decode("utf-8")), dict), data
        done += 1
    assert done >= 50  # enough walks closed to mean something
