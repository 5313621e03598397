"""Streamed text and how speculation produced it.

A generation streams one `Piece` a speculative step: the text the step's tokens add (less
what stop strings hold back), the kind of each token, and the steps it completes. A token
is one of

    draft       a model draft the target accepted
    lookup      a prompt-lookup draft the target accepted
    bonus       the target's own token after it accepted every draft of the step
    correction  the target's own token in place of the first draft it rejected
    target      the target's own token in a step that drafted nothing (the first token,
                plain decoding, a lookup that found no match)

so a step of K drafts of which n were accepted gives n draft (or lookup) tokens, then one
bonus (n = K > 0), correction (n < K) or target (K = 0) token. Every step is one target
call: the first is the prompt's ("prefill"), the others are the generation's
`target_calls` (stats.py), and their accepted drafts add up to its `accepted_tokens`.

A token's characters are what it adds to the decoded text: a token that ends in the middle
of a UTF-8 character adds none, and the token that completes the character adds it whole.
A piece's marks cover its text exactly (their characters add up to `len(text)`), a token at
a time and each token once, because the stop-string holdback only ever shows whole tokens
(stop_strings.py); only the text's last token can be cut, by the stop string itself.
Tokens after a stop string, or the end-of-sequence token, are not marked, but their steps
are listed: they were target calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from specedge.runtime.loop import Step
from specedge.runtime.stop_strings import StopStringHoldback

TOKEN_KINDS = ("draft", "lookup", "bonus", "correction", "target")


@dataclass(frozen=True)
class StepMark:
    """One speculative step: `drafted` tokens proposed by `source` (the drafter's name,
    "lookup+model/lookup" for the lookup half of lookup+model; "prefill" for the prompt's
    call, "none" without a drafter), the first `accepted` of them accepted."""

    drafted: int
    accepted: int
    source: str


@dataclass(frozen=True)
class Piece:
    """Text a generation shows, `marks` its tokens as (characters, kind) in order, and
    `steps` the steps whose last token it shows (or that ended it)."""

    text: str
    marks: tuple[tuple[int, str], ...] = ()
    steps: tuple[StepMark, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.text or self.marks or self.steps)

    @staticmethod
    def joined(pieces: Sequence[Piece]) -> Piece:
        """Consecutive pieces as one (a stream that sends what arrived meanwhile at once)."""
        return Piece("".join(p.text for p in pieces),
                     tuple(m for p in pieces for m in p.marks),
                     tuple(s for p in pieces for s in p.steps))


def token_kinds(drafted: int, accepted: int, source: str) -> list[str]:
    """The kinds of a step's accepted + 1 tokens (before any end-of-sequence cut)."""
    draft = "lookup" if source.endswith("lookup") else "draft"
    own = "target" if drafted == 0 else "bonus" if accepted == drafted else "correction"
    return [draft] * accepted + [own]


class PieceMaker:
    """The steps of one generation into pieces: give it each step with the text of each of
    its tokens (`add`) until it has `stopped` (a stop string) or the steps end, then
    `finish`. An `empty` piece need not be shown."""

    def __init__(self, stops: Sequence[str]):
        self.holdback = StopStringHoldback(stops)
        self._tokens: deque[tuple[int, str]] = deque()   # (text end, kind), not yet shown
        self._steps: deque[tuple[int, StepMark]] = deque()  # (tokens through its last, step)
        self._fed_chars = 0   # characters of every token fed, before a stop-string cut
        self._fed_tokens = 0
        self._shown_tokens = 0

    @property
    def stopped(self) -> bool:
        return self.holdback.stopped

    def add(self, step: Step, texts: Sequence[str]) -> Piece:
        """The piece for `step`, whose tokens (after any end-of-sequence cut) gave `texts`."""
        mark = StepMark(step.drafted, step.accepted, step.source)
        kinds = token_kinds(step.drafted, step.accepted, step.source)
        shown = []
        for text, kind in zip(texts, kinds):
            if self.holdback.stopped:
                break
            self._fed_chars += len(text)
            self._fed_tokens += 1
            self._tokens.append((self._fed_chars, kind))
            shown.append(self.holdback.feed(text))
        self._steps.append((self._fed_tokens, mark))
        return self._piece("".join(shown))

    def finish(self) -> Piece:
        """What is still held back once the generation has ended."""
        return self._piece(self.holdback.rest(), last=True)

    def _piece(self, text: str, last: bool = False) -> Piece:
        """`text`, just shown, with the marks of the tokens it ends and the steps they end.
        The marks start where the text does: every earlier token was marked with the text
        before it."""
        end = self.holdback.shown
        at, marks = end - len(text), []
        # Whole tokens, then (stopped) the one the stop string cuts.
        while self._tokens and (self._tokens[0][0] <= end or
                                (self.holdback.stopped or last) and at < end):
            token_end, kind = self._tokens.popleft()
            marks.append((min(token_end, end) - at, kind))
            at = min(token_end, end)
            self._shown_tokens += 1
        if self.holdback.stopped or last:
            self._tokens.clear()  # past the stop string: never shown
            self._shown_tokens = self._fed_tokens
        steps = []
        while self._steps and self._steps[0][0] <= self._shown_tokens:
            steps.append(self._steps.popleft()[1])
        return Piece(text, tuple(marks), tuple(steps))
