"""Stop strings over streamed text: held back while they may be forming, never shown."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.stop import StopChecker


def _feed_all(checker: StopChecker, pieces: list[str]) -> tuple[list[str], str | None]:
    shown, stop = [], None
    for piece in pieces:
        r = checker.feed(piece)
        shown.append(r.text)
        if r.stopped:
            return shown, r.stop
    shown.append(checker.flush())
    return shown, stop


def test_stop_string_split_across_increments() -> None:
    c = StopChecker(["</end>"])
    assert [c.feed(t).text for t in ["Hello </", "en"]] == ["Hello ", ""]
    r = c.feed("d> trailing")
    assert (r.text, r.stopped, r.stop) == ("", True, "</end>") and c.stopped
    with pytest.raises(ValueError, match="after a stop"):
        c.feed("more")


def test_held_back_prefix_is_released_when_it_breaks_off() -> None:
    c = StopChecker(["STOP"])
    assert c.feed("ab ST").text == "ab "
    assert c.feed("Ox").text == "STOx"
    assert c.feed("S").text == "" and c.flush() == "S"


def test_multiple_and_overlapping_stop_strings() -> None:
    shown, stop = _feed_all(StopChecker(["abc", "bcd", "x"]), ["zab", "cd"])
    assert "".join(shown) == "z" and stop == "abc"  # "abc" completes before "bcd"
    shown, stop = _feed_all(StopChecker(["aab"]), ["a", "a", "a", "b", "c"])
    assert "".join(shown) == "a" and stop == "aab"  # the match starts one 'a' later
    shown, stop = _feed_all(StopChecker(["b", "abc"]), ["xa", "bc"])
    assert "".join(shown) == "xa" and stop == "b"  # "b" completes first
    shown, stop = _feed_all(StopChecker(["\n\n", "END"], True), ["one\n", "\ntwo"])
    assert "".join(shown) == "one\n\n" and stop == "\n\n"


def test_no_stop_strings_pass_text_through() -> None:
    c = StopChecker([])
    assert c.feed("abc").text == "abc" and c.flush() == ""


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, neg, s = min(hits)
    return text[: end if include else end + neg], s


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_stop_checker_matches_whole_text_reference(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    shown, stop = _feed_all(StopChecker(stops, include), pieces)
    want_text, want_stop = _reference_stop(text, stops, include)
    assert ("".join(shown), stop) == (want_text, want_stop)
    if not include:  # no emitted prefix ever shows a stop string
        so_far = ""
        for piece in shown:
            so_far += piece
            assert not any(s in so_far for s in stops)
