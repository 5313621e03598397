"""runtime/stop_strings.py: the text shown before a stop string, however the pieces split it,
and nothing of a stop string ever shown."""

from __future__ import annotations

import itertools

import pytest

from specedge.runtime.stop_strings import StopStringHoldback


def shown(stops: list[str], pieces: list[str]) -> tuple[list[str], str, bool]:
    holdback = StopStringHoldback(stops)
    out = []
    for piece in pieces:
        out.append(holdback.feed(piece))
        if holdback.stopped:
            break
    out.append(holdback.rest())
    return out, holdback.text, holdback.stopped


def splits(text: str, cuts: int):
    """Every way of cutting `text` into `cuts + 1` pieces (empty pieces included)."""
    for at in itertools.combinations_with_replacement(range(len(text) + 1), cuts):
        bounds = (0, *at, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("pieces", list(splits("Thought: yes\nObservation: no", 2)))
def test_the_text_ends_before_the_stop_string_whatever_the_split(pieces):
    out, text, stopped = shown(["Observation:"], pieces)
    assert stopped and text == "Thought: yes\n"
    assert "".join(out) == text


def test_the_earliest_of_several_stop_strings_wins():
    out, text, _ = shown(["END", "ab"], ["xxab", "cEND"])
    assert text == "xx" and "".join(out) == "xx"


def test_the_last_characters_that_could_begin_a_stop_string_wait_for_the_next_piece():
    """The last len("STOP") - 1 = 3 characters wait, and with them the rest of their piece:
    what is shown is whole pieces."""
    holdback = StopStringHoldback(["STOP"])
    assert holdback.feed("hello ") == ""      # "llo " could still begin "STOP"
    assert holdback.feed("wor") == "hello "   # "wor" waits
    assert holdback.feed("ld") == ""          # "rld" waits, and "wor" with it
    assert holdback.feed("!!!!") == "world"
    assert holdback.rest() == "!!!!"
    assert not holdback.stopped and holdback.text == "hello world!!!!"


def test_a_stop_string_inside_a_piece_shows_the_piece_up_to_it():
    holdback = StopStringHoldback(["STOP"])
    assert holdback.feed("ab") == ""
    assert holdback.feed("cSTOPd") == "abc"
    assert holdback.stopped and holdback.text == "abc" and holdback.rest() == ""


def test_without_stop_strings_every_piece_is_shown_at_once():
    holdback = StopStringHoldback([])
    assert [holdback.feed(p) for p in ["a", "bc", ""]] == ["a", "bc", ""]
    assert holdback.rest() == "" and holdback.text == "abc"


def test_exactly_the_last_three_characters_wait_for_a_four_character_stop_string():
    """One character a piece: each is shown once three more have come (len("STOP") - 1),
    not one piece sooner or later."""
    holdback = StopStringHoldback(["STOP"])
    assert [holdback.feed(c) for c in "abcdef"] == ["", "", "", "a", "b", "c"]
    assert holdback.rest() == "def"


@pytest.mark.parametrize("pieces", [["xxSTO", "P"], ["x", "x", "S", "T", "O", "P"],
                                    ["xxS", "TOP"]])
def test_a_stop_string_that_the_new_piece_completes_is_found_at_its_earliest_start(pieces):
    """The new piece can complete a stop string that began len("STOP") - 1 characters
    before it: the search must start at least that far back."""
    out, text, stopped = shown(["STOP"], pieces)
    assert stopped and text == "xx" and "".join(out) == "xx"
