"""Drafters propose K tokens after the context, with their probabilities q (DESIGN step 1).

`start(prompt, capacity)` begins a generation (a model drafter prefills the prompt).
`propose` returns (token ids, q) where q is [k, vocab] processed draft probabilities (numpy
rows, or their device address with device sampling), or None when q is one-hot (greedy
drafting, or a model-free drafter: DESIGN step 6). A `threshold` > 0 stops drafting after
the first token whose draft probability q(x) is below it: the tokens after a doubtful one
are likely wasted. The doubtful token itself is kept: dropping a
token because of its own value would make the proposal differ from q, and the acceptance
test would no longer be exact when sampling.
`rollback(n)` tells the drafter that only the first n context tokens are still valid.
`source(context)` names what will propose the next draft (lookup+model has two sources):
auto keeps the acceptance and costs of each source apart (draft_length.py).
`calls` counts the drafter's forward calls, for the cost ratio c; `caught_up` is how many
tokens the first of them took in during the last `propose` (0: no model call): more than
the last step's new tokens means the draft had fallen behind (the prompt, steps at K = 0 or
drafted by lookup), a one-off cost that auto does not count as the price of a draft step
(draft_length.py). A drafter with `needs_features` is given the target's features after
every target call (`observe`).
"""

from __future__ import annotations

import numpy as np

from .backends import Backend
from .params import Sampling
from .token_choice import choice_for


class ModelDrafter:
    """A small draft model with its own KV cache, run one token at a time; `choice` says
    where its tokens and q rows are computed (token_choice.py)."""

    name = "model"
    needs_features = False

    def __init__(self, backend: Backend):
        self.backend = backend
        self.choice = choice_for(backend)
        self.cache = None
        self.calls = 0
        self.caught_up = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        if self.cache is None or self.cache.capacity != capacity:
            self.cache = self.backend.new_cache(capacity)
        self.cache.rollback(0)
        self.choice.run(self.backend, self.cache, prompt, 1)

    def source(self, context: list[int]) -> str:
        return self.name

    def propose(self, context: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator, threshold: float = 0.0) -> tuple[list[int], object]:
        ids, q = [], []
        for i in range(k):
            rows = self._catch_up(context) if i == 0 else self._next(ids[-1])
            self.calls += 1
            x, q_x = self.choice.draw(rows, sampling, rng, q, threshold > 0)
            ids.append(x)
            if q_x < threshold:
                break
        return ids, self.choice.q(q)

    def _catch_up(self, context: list[int]):
        """The first draft step: the cache holds rows for a prefix of the context; the rest
        (1 or 2 tokens, more after lookup drafts) goes in with it."""
        self.caught_up = len(context) - self.cache.length
        return self.choice.run(self.backend, self.cache, context[self.cache.length:], 1)

    def _next(self, token: int):
        return self.choice.run(self.backend, self.cache, [token], 1)

    def rollback(self, length: int) -> None:
        self.cache.rollback(min(length, self.cache.length))


class FeatureDrafter(ModelDrafter):
    """A feature draft (export/feature_draft.py): pair r is (target feature f_r, token
    x_{r+1}), so cache row r needs the target's f_r, known once the target has run position
    r. With context x_0..x_{m-1}, f_0..f_{m-2} are known: the first draft step feeds the
    pairs the cache lacks up to r = m - 2 and predicts x_m; each later step feeds its own
    predicted feature with the token it drew. Rows built on predicted features are dropped
    at rollback and rebuilt from the target's features at the next draft. Host choice only
    (the ort-cpu backend, which outputs features)."""

    needs_features = True

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.target_features = None  # [capacity, H]: the target's f_r by position r
        self.exact_rows = 0          # cache rows built on target features only
        self._predicted = None       # [1, H]: the draft's latest f^

    def start(self, prompt: list[int], capacity: int) -> None:
        if self.cache is None or self.cache.capacity != capacity:
            self.cache = self.backend.new_cache(capacity)
            self.target_features = np.zeros((capacity, self.backend.spec.features),
                                            np.float32)
        self.cache.rollback(0)
        self.exact_rows = 0

    def observe(self, features: np.ndarray, start: int) -> None:
        """The target's features for positions [start, start + T), from its last call."""
        self.target_features[start:start + len(features)] = features

    def _catch_up(self, context: list[int]):
        first, last = self.cache.length, len(context) - 1
        self.caught_up = last - first
        rows = self.backend.forward(self.cache, context[first + 1:last + 1], 1,
                                    self.target_features[first:last])
        self.exact_rows = self.cache.length
        self._predicted = self.backend.features[-1:]
        return rows

    def _next(self, token: int):
        rows = self.backend.forward(self.cache, [token], 1, self._predicted)
        self._predicted = self.backend.features[-1:]
        return rows

    def rollback(self, length: int) -> None:
        self.cache.rollback(min(length - 1, self.exact_rows, self.cache.length))


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
