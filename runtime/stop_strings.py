"""Stop strings on streamed text: the text ends just before the first stop string, and a
piece is shown only once no stop string can start in it.

A stop string may arrive split over several pieces ("Ob" + "serv" + "ation:"), so the last
`longest - 1` characters are held back until the next piece shows they do not begin one
(or the generation ends). The search for a new match starts `longest` characters before
the new piece: no earlier match can have been completed by it.

A piece is one token's text, and what is shown always ends where a piece ends (or at the
stop string): the text shown is whole tokens, so that each token's kind can be shown with
its characters (pieces.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStringHoldback:
    """Feed text pieces (a token's text each) in order; each `feed` returns the text now
    safe to show: whole pieces, up to the last one no stop string can still begin in."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""        # the text so far, cut before a stop string once one appears
        self.stopped = False  # a stop string appeared: feed nothing more
        self._shown = 0       # characters of `text` returned so far
        self._ends: deque[int] = deque()  # where the pieces not yet shown end

    @property
    def shown(self) -> int:
        """Characters of `text` returned so far."""
        return self._shown

    def feed(self, piece: str) -> str:
        search_from = max(0, len(self.text) - self.longest)
        self.text += piece
        self._ends.append(len(self.text))
        cut = min((i for s in self.stops if (i := self.text.find(s, search_from)) >= 0),
                  default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            return self._show(cut)
        safe, ready = len(self.text) - max(0, self.longest - 1), self._shown
        while self._ends and self._ends[0] <= safe:
            ready = self._ends.popleft()
        return self._show(ready)

    def rest(self) -> str:
        """What is still held back, when the generation has ended."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        if upto <= self._shown:
            return ""
        out, self._shown = self.text[self._shown:upto], upto
        return out
