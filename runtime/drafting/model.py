"""A small draft model with its own KV cache, run one token at a time (a `Drafter`,
drafting/drafter.py)."""

from __future__ import annotations

import numpy as np

from specedge.runtime.backends import Backend
from specedge.runtime.config import Sampling
from specedge.runtime.token_selection import selector_for


class ModelDrafter:
    """A small draft model with its own KV cache, run one token at a time; `selector` says
    where its tokens and q rows are computed (token_selection.py)."""

    name = "model"
    needs_features = False

    def __init__(self, backend: Backend, kept: int = 0):
        """`kept`: rows of the backend's cache that hold the first tokens of the prompt
        already (a batch slot's rows of an earlier sequence, runtime/batch.py)."""
        self.backend = backend
        self.kept = kept
        self.selector = selector_for(backend)
        self.cache = None
        self.calls = 0
        self.caught_up = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        """A cache holding only the `kept` rows: the rest of the prompt goes in with the
        first draft step (`_catch_up`), so that the first token does not wait for it, and a
        generation that never drafts (auto K at a batch size where drafting does not pay,
        batch.py) never runs it. The kept rows stay counted until then: a batch slot's
        rows past its length are free to the others' calls (their padding is written
        there) and a resize of the slots copies only the rows counted."""
        if self.cache is None or self.cache.capacity != capacity:
            self.cache = self.backend.new_cache(capacity)
        self.cache.rollback(min(self.cache.length, self.kept))

    def source(self, context: list[int]) -> str:
        return self.name

    def observe(self, features: np.ndarray, start: int) -> None:
        pass  # a token-only draft: no features (FeatureDrafter reads them)

    def propose(self, context: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator, threshold: float = 0.0) -> tuple[list[int], object]:
        ids, q = [], []
        for i in range(k):
            rows = self._catch_up(context) if i == 0 else self._next(ids[-1])
            self.calls += 1
            x, q_x = self.selector.draw(rows, sampling, rng, q, threshold > 0)
            ids.append(x)
            if q_x < threshold:
                break
        return ids, self.selector.q(q)

    def _catch_up(self, context: list[int]):
        """The first draft step: the cache holds rows for a prefix of the context; the rest
        (1 or 2 tokens, more after lookup drafts or steps without drafts, the whole prompt
        at the first) goes in with it."""
        self.caught_up = len(context) - self.cache.length
        return self.selector.call_model(self.backend, self.cache, context[self.cache.length:], 1)

    def _next(self, token: int):
        return self.selector.call_model(self.backend, self.cache, [token], 1)

    def rollback(self, length: int) -> None:
        self.cache.rollback(min(length, self.cache.length))
