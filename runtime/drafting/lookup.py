"""Model-free drafting from the context itself (prompt lookup), alone or in front of a
draft model."""

from __future__ import annotations

import numpy as np

from specedge.runtime.config import Sampling
from specedge.runtime.drafting.model import ModelDrafter


class PromptLookupDrafter:
    """Model-free n-gram drafting: find the latest earlier occurrence of the context's last
    n tokens (n = max_ngram .. min_ngram) and propose the tokens that followed it. q is
    one-hot."""

    name = "prompt-lookup"
    needs_features = False
    caught_up = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.calls = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        pass

    def source(self, context: list[int]) -> str:
        return self.name

    def observe(self, features: np.ndarray, start: int) -> None:
        pass  # drafts from the context alone: no features

    def propose(self, context: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator, threshold: float = 0.0) -> tuple[list[int], None]:
        """q is one-hot (certain), so `threshold` never cuts a lookup draft short."""
        self.calls += 1
        start = self.match(context)
        return ([] if start is None else context[start:start + k]), None

    def match(self, context: list[int]) -> int | None:
        """Where the tokens that followed the latest match of the context's tail start."""
        tokens = np.asarray(context)
        last = len(tokens) - 1
        # A match of n tokens ends at some p <= last - 1 with tokens[p] == tokens[last], so
        # it is followed by at least one token and the tail never matches itself. Only
        # those ends are examined (one pass over the context, then a few tokens each): a
        # window view of the whole context per n cost 0.14-0.25 ms a step, about 1%.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[tokens[hits - back] == tokens[last - back]]
            if hits.size:
                return int(hits[-1] + 1)
        return None

    def rollback(self, length: int) -> None:
        pass


class LookupThenModelDrafter:
    """Prompt lookup where the context repeats its last two or more tokens (a summary
    quoting its passage, code reusing its names), the draft model elsewhere. One-token
    matches are left to the model: as a lookup they are accepted about 0.2 of the time.

    Each step is verified against the q of the drafter that proposed it (one-hot for a
    lookup), so the output stays exact. The model's cache skips the steps drafted by
    lookup and catches up on the tokens it missed at its next draft. The two are separate
    sources for auto: a lookup that matched two tokens is worth a long K (its later
    positions are accepted 0.8-0.9 of the time), the model K = 1 or none.
    """

    name = "lookup+model"

    def __init__(self, model: ModelDrafter):
        self.model = model
        self.lookup = PromptLookupDrafter(min_ngram=2)
        self._match: tuple[int, int | None] = (-1, None)  # (context length, match start)

    @property
    def calls(self) -> int:
        return self.model.calls + self.lookup.calls

    @property
    def needs_features(self) -> bool:
        return self.model.needs_features

    @property
    def caught_up(self) -> int:
        """0 on a step the lookup drafted (this step's match), else the model's."""
        return 0 if self._match[1] is not None else self.model.caught_up

    def observe(self, features: np.ndarray, start: int) -> None:
        self.model.observe(features, start)

    def start(self, prompt: list[int], capacity: int) -> None:
        self.model.start(prompt, capacity)
        self._match = (-1, None)

    def _lookup(self, context: list[int]) -> int | None:
        """The lookup's match for this context, found once per step (the context only
        changes between steps, and always in length)."""
        if self._match[0] != len(context):
            self._match = (len(context), self.lookup.match(context))
        return self._match[1]

    def source(self, context: list[int]) -> str:
        lookup = self._lookup(context) is not None
        return f"{self.name}/{'lookup' if lookup else self.model.name}"

    def propose(self, context: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator, threshold: float = 0.0) -> tuple[list[int], object]:
        start = self._lookup(context)
        if start is not None:
            self.lookup.calls += 1
            return context[start:start + k], None
        return self.model.propose(context, k, sampling, rng, threshold)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)
