"""Probability rows and one draw from them: the distributions the speculative loop compares
(docs/design.md#the-speculative-step) and samples, dense or kept as their support
(:class:`SparseProbs`, which runtime/sampling.py makes from logits)."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import NamedTuple

import numpy as np

__all__ = ["SparseProbs", "as_sparse", "sample"]

# Supports up to this size are walked in plain Python floats, not numpy calls. On the
# machines measured, each numpy call right after a model call costs 20-80 us while its code
# and data are brought back into cache (a tiny add: 35 us, against 1 us when warm), so a
# step's host time is counted in calls more than in elements.
SMALL = 256


class SparseProbs(NamedTuple):
    """One processed row kept as its support: token ``ids`` (ascending) and their float64
    probabilities ``p``; every other token of the ``vocab`` has probability 0."""

    ids: np.ndarray
    p: np.ndarray
    vocab: int

    def at(self, tokens: int | np.ndarray) -> np.ndarray | float:
        """The probabilities of ``tokens`` (ids in ``[0, vocab)``), 0 outside the support."""
        if self.ids.size == self.vocab:  # every token: the ids are arange(vocab)
            return float(self.p[tokens]) if isinstance(tokens, int) else self.p[tokens]
        if isinstance(tokens, int) and self.ids.size <= SMALL:
            ids = self.ids.tolist()
            i = bisect_left(ids, tokens)
            return float(self.p[i]) if i < len(ids) and ids[i] == tokens else 0.0
        if not self.ids.size:
            return np.zeros(np.shape(tokens))
        pos = np.minimum(np.searchsorted(self.ids, tokens), self.ids.size - 1)
        return np.where(self.ids[pos] == tokens, self.p[pos], 0.0)

    def dense(self) -> np.ndarray:
        if self.ids.size == self.vocab:
            return self.p.copy()
        out = np.zeros(self.vocab)
        out[self.ids] = self.p
        return out


def as_sparse(probs: np.ndarray | SparseProbs) -> SparseProbs:
    """A dense probability row [V] as its support (a SparseProbs is returned as it is)."""
    if isinstance(probs, SparseProbs):
        return probs
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"expected a 1-D probability row, got shape {p.shape}")
    ids = np.flatnonzero(p != 0)  # a float row's nonzero() is 10x slower than a compare
    return SparseProbs(ids, p[ids], p.shape[0])


def sample(probs: np.ndarray | SparseProbs, rng: np.random.Generator) -> int:
    """Draw one token from a probability row, using exactly one uniform.

    Inverse CDF: with ``c = cumsum(p)`` and ``t = u * c[-1]``, ``u ~ U[0, 1)``, return the
    first ``i`` with ``c[i] > t``. Token ``i`` owns the interval ``[c[i-1], c[i])``, whose
    length is ``p[i]``, so a zero-probability token owns an empty interval and can never
    be drawn. Scaling by ``c[-1]`` means ``probs`` need not be exactly normalised.

    Args:
        probs: a dense row ``[V]`` (non-negative, positive total) or its support.
        rng: consumed by exactly one ``rng.random()`` call (reproducibility of the loop).

    Returns:
        The sampled token id.

    Raises:
        ValueError: wrong shape, or a total that is not positive and finite.
    """
    if isinstance(probs, SparseProbs):
        support, p = probs.ids, probs.p
    else:
        p = np.asarray(probs, dtype=np.float64)
        if p.ndim != 1 or p.shape[0] == 0:
            raise ValueError(f"sample: expected a 1-D probability vector, got shape {p.shape}")
        # After top-k / top-p most entries are 0. Adding 0.0 leaves a float sum unchanged,
        # so the cumulative sums over the nonzero entries are those of the whole row, and
        # the first index past u * total is the same token: walk only those (same result,
        # bit for bit, as walking the support of a SparseProbs).
        sparse = as_sparse(p)
        support, p = (sparse.ids, sparse.p) if 2 * sparse.ids.size < p.shape[0] else (None, p)
    # A short row's running sums in Python floats (SMALL): the same float64 sums, in order.
    cdf = list(accumulate(p.tolist())) if p.shape[0] <= SMALL else np.cumsum(p)
    total = cdf[-1] if len(cdf) else 0.0
    if not (math.isfinite(total) and total > 0):
        raise ValueError(
            f"sample: probabilities must be finite with a positive total, got total {total!r}"
        )
    u = rng.random()
    idx = bisect_right(cdf, u * total)
    if idx >= p.shape[0]:
        # Unreachable as far as we know: u < 1 makes u * c[-1] < c[-1] in floating point
        # too. Cheap insurance all the same; p[V-1] may be 0, so clamp to the last token
        # that can actually be drawn, never to a blind V - 1.
        idx = int(np.flatnonzero(p > 0)[-1])
    return idx if support is None else int(support[idx])
