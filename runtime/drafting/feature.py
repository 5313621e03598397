"""A feature draft: one layer that reads the target's features (EAGLE-style)."""

from __future__ import annotations

import numpy as np

from specedge.runtime.backends import Backend
from specedge.runtime.drafting.model import ModelDrafter


class FeatureDrafter(ModelDrafter):
    """A feature draft (export/drafts/feature.py): pair r is (target feature f_r, token
    x_{r+1}), so cache row r needs the target's f_r, known once the target has run position
    r. With context x_0..x_{m-1}, f_0..f_{m-2} are known: the first draft step feeds the
    pairs the cache lacks up to r = m - 2 and predicts x_m; each later step feeds its own
    predicted feature with the token it drew. Rows built on predicted features are dropped
    at rollback and rebuilt from the target's features at the next draft. Host token choice only
    (the ort-cpu backend, which outputs features)."""

    needs_features = True

    def __init__(self, backend: Backend, kept: int = 0):
        """`kept`: rows of the backend's cache that hold the pairs of the prompt's first
        tokens already, built on the target's features (a batch slot's rows of an earlier
        sequence, runtime/batch.py)."""
        super().__init__(backend, kept)
        self.target_features = None  # [capacity, H]: the target's f_r by position r
        self.exact_rows = 0          # cache rows built on target features only
        self._predicted = None       # [1, H]: the draft's latest f^

    def start(self, prompt: list[int], capacity: int) -> None:
        if self.cache is None or self.cache.capacity != capacity:
            self.cache = self.backend.new_cache(capacity)
            self.target_features = np.zeros((capacity, self.backend.spec.features),
                                            np.float32)
        self.cache.rollback(min(self.cache.length, self.kept))
        self.exact_rows = self.cache.length

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
