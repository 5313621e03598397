"""runtime/pieces.py: each streamed token's kind (an accepted draft or the target's own),
the marks covering each piece's text exactly, and the steps of a generation matching its
statistics."""

from __future__ import annotations

from collections import Counter

import pytest

from specedge.runtime import Generator
from specedge.runtime.loop import Step
from specedge.runtime.pieces import Piece, PieceMaker, StepMark, token_kinds


def test_token_kinds_name_the_drafts_and_the_targets_own_token():
    assert token_kinds(0, 0, "prefill") == ["target"]
    assert token_kinds(4, 4, "model") == ["draft"] * 4 + ["bonus"]
    assert token_kinds(4, 1, "model") == ["draft", "correction"]
    assert token_kinds(3, 0, "lookup") == ["correction"]
    assert token_kinds(2, 2, "lookup+model/lookup") == ["lookup", "lookup", "bonus"]
    assert token_kinds(2, 1, "lookup+model/model") == ["draft", "correction"]


def make(stops: list[str], steps: list[tuple[Step, list[str]]]) -> list[Piece]:
    maker = PieceMaker(stops)
    out = []
    for step, texts in steps:
        out.append(maker.add(step, texts))
        if maker.stopped:
            break
    return [*out, maker.finish()]


def test_each_token_is_marked_once_with_its_characters():
    """A token ending inside a character adds none (""), the next adds it whole; the marks
    of every piece cover its text exactly."""
    pieces = make([], [(Step([1], 0, 0, 0, "prefill"), ["Hi"]),
                       (Step([2, 3, 4], 3, 2, 3, "model"), [" th", "", "é"]),
                       (Step([5, 6], 1, 1, 1, "lookup"), ["re", "!"])])
    assert [p.text for p in pieces] == ["Hi", " thé", "re!", ""]
    assert [p.marks for p in pieces] == [
        ((2, "target"),), ((3, "draft"), (0, "draft"), (1, "correction")),
        ((2, "lookup"), (1, "bonus")), ()]
    assert [p.steps for p in pieces] == [(StepMark(0, 0, "prefill"),),
                                         (StepMark(3, 2, "model"),),
                                         (StepMark(1, 1, "lookup"),), ()]
    for piece in pieces:
        assert sum(n for n, _ in piece.marks) == len(piece.text)


def test_a_stop_string_cuts_the_marks_with_the_text():
    """Held-back text waits with its marks and its step; the token the stop string cuts is
    marked with the characters before it, the tokens after it not at all, and every step
    that ran is listed."""
    pieces = make(["XY"], [(Step([1], 0, 0, 0, "prefill"), ["ab"]),
                           (Step([2, 3], 2, 1, 2, "model"), ["cX", "Yd"]),
                           (Step([4], 0, 0, 0, "none"), ["never"])])
    assert [p.text for p in pieces] == ["", "abc", ""]
    assert pieces[1].marks == ((2, "target"), (1, "draft"))
    assert pieces[0].steps == () and pieces[1].steps == (StepMark(0, 0, "prefill"),
                                                         StepMark(2, 1, "model"))


def test_held_back_text_comes_with_its_marks_at_the_end():
    pieces = make(["STOP"], [(Step([1], 0, 0, 0, "prefill"), ["hello"]),
                             (Step([2], 2, 0, 2, "model"), ["!"])])
    assert "".join(p.text for p in pieces) == "hello!"
    assert [m for p in pieces for m in p.marks] == [(5, "target"), (1, "correction")]
    assert [p.text for p in pieces] == ["", "", "hello!"]  # "llo" and "lo!" could begin STOP
    assert pieces[-1].steps == (StepMark(0, 0, "prefill"), StepMark(2, 0, "model"))


def test_an_end_of_sequence_cut_step_is_listed_without_marks():
    pieces = make([], [(Step([1], 0, 0, 0, "prefill"), ["a"]),
                       (Step([], 2, 0, 2, "model"), [])])
    assert pieces[1] == Piece("", (), (StepMark(2, 0, "model"),))


def test_joined_pieces_keep_every_mark_and_step():
    a = Piece("ab", ((2, "target"),), (StepMark(0, 0, "prefill"),))
    b = Piece("c", ((1, "bonus"),), (StepMark(1, 1, "model"),))
    assert Piece.joined([a, b]) == Piece("abc", ((2, "target"), (1, "bonus")),
                                         (StepMark(0, 0, "prefill"), StepMark(1, 1, "model")))
    assert Piece("", (), ()).empty and not a.empty


@pytest.mark.parametrize("settings", [
    {"drafter": "model", "draft_tokens": 3},
    {"drafter": "lookup+model", "draft_tokens": 4},
    {"drafter": "lookup+model", "draft_tokens": "auto"},
    {"drafter": "model", "draft_tokens": 4, "temperature": 0.8, "seed": 3},
    {"use_draft": False},
])
def test_a_generations_pieces_match_its_text_tokens_and_statistics(tiny_bundle, settings):
    """Over a real generation: the pieces' text is the result's, one mark per token and
    the marks' characters adding up to the text, one step per target call plus the
    prompt's, drafted and accepted tokens adding up to the statistics, and the kinds
    following from each step's counts."""
    gen = Generator.from_bundle(tiny_bundle)
    stream = gen.stream_pieces("the cat sat on the mat", raw=True, max_new_tokens=60,
                               **settings)
    pieces = []
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as done:
            result = done.value
            break
    assert "".join(p.text for p in pieces) == result.text
    marks = [m for p in pieces for m in p.marks]
    steps = [s for p in pieces for s in p.steps]
    shown = len(result.token_ids) - (result.stop_reason == "eos")
    assert len(marks) == shown and sum(n for n, _ in marks) == len(result.text)
    assert steps[0] == StepMark(0, 0, "prefill") and len(steps) == \
        result.stats["target_calls"] + 1
    assert sum(s.drafted for s in steps) == result.stats["drafted_tokens"]
    assert sum(s.accepted for s in steps) == result.stats["accepted_tokens"]
    kinds = Counter(kind for _, kind in marks)
    assert kinds["draft"] + kinds["lookup"] == result.stats["accepted_tokens"]
    assert kinds["bonus"] + kinds["correction"] + kinds["target"] == len(steps) or \
        result.stop_reason == "eos"
    if isinstance(settings.get("draft_tokens"), int):
        # auto K may draft nothing on a slow or busy machine: what it drafts is checked above
        assert kinds["draft"] + kinds["lookup"] > 0 and kinds["correction"] > 0
    elif not settings.get("use_draft", True):
        assert set(kinds) == {"target"}
