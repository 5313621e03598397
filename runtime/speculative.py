"""Verification of drafted tokens: the exact speculative step of
docs/design.md#the-speculative-step.

Notation (docs/design.md#the-speculative-step): the draft proposed ``x_1..x_K`` from ``q_1..q_K``;
one target pass gave ``p_1..p_{K+1}``; both already processed by
:func:`specedge.runtime.sampling.process_logits` with the same settings.

Sampled verification (steps 3, 4, 6), for ``i = 1..K``::

    u_i ~ U[0, 1)
    accept x_i  iff  u_i * q_i(x_i) < p_i(x_i)        # P(accept) = min(1, p_i(x_i) / q_i(x_i))
    on the first rejection emit  y ~ norm(max(0, p_i - q_i))  and stop
    if all K accepted, emit the bonus  y ~ p_{K+1}

For ``x ~ q`` this emits ``y`` with probability
``min(p, q)(y) + (sum_x max(0, q - p)(x)) * max(0, p - q)(y) / sum max(0, p - q) = p(y)``,
because both sums are the total variation distance between p and q; so the output
follows the target exactly, token by token, whatever the draft. Greedy verification
(step 5) is the ``T -> 0`` limit: accept while ``x_i == argmax p_i``.

Random numbers: :func:`verify_sampled` draws exactly one uniform per examined draft token
plus one per emitted sample, all from the caller's ``numpy.random.Generator``, so a seeded
run is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specedge.runtime.probs import SparseProbs, as_sparse, sample

__all__ = ["residual", "verify_greedy", "verify_sampled"]


def residual(p: np.ndarray | SparseProbs, q: np.ndarray | SparseProbs
             ) -> np.ndarray | SparseProbs:
    """Residual distribution ``norm(max(0, p - q))`` sampled after a rejection (step 3).

    Its support lies inside p's (``p - q > 0`` needs ``p > 0``), so a token that top-k or
    top-p removed from the target can never be emitted, and for rows given as their
    supports it is computed on p's support only. Its mass equals the rejection
    probability ``sum_x q(x) (1 - min(1, p(x)/q(x)))``; when that mass is 0 (``p == q``)
    a rejection cannot happen, and ``p`` is returned so the result is still a
    distribution.

    Args:
        p: target probabilities, shape ``[V]`` or its support.
        q: draft probabilities, shape ``[V]`` or its support.

    Returns:
        float64 probabilities: a SparseProbs on p's support when either row is one, else a
        dense row ``[V]``.
    """
    if isinstance(p, SparseProbs) or isinstance(q, SparseProbs):
        p, q = as_sparse(p), as_sparse(q)
        # On a full support (every token) q's dense row is q at p's ids, without a search.
        r = np.subtract(p.p, q.dense() if p.ids.size == p.vocab else q.at(p.ids))
    else:
        p = np.asarray(p, dtype=np.float64)
        r = np.subtract(p, q, dtype=np.float64)
    np.maximum(r, 0.0, out=r)
    return _normalised(r, p)


def verify_greedy(draft_ids: Sequence[int], target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy verification (docs/design.md#the-speculative-step step 5).

    Accept ``x_i`` while ``x_i == argmax p_i``; the next token is ``argmax`` of the first
    mismatching row (the correction) or of row ``K`` (the bonus). Ties go to the lowest
    token id (``np.argmax``), the same rule the draft must use.

    Args:
        draft_ids: the K drafted tokens (K may be 0).
        target_logits: shape ``[K + 1, V]``; raw logits or probabilities (argmax only).

    Returns:
        ``(n_accepted, next_token)``; the step emits ``draft_ids[:n_accepted] + [next_token]``.

    Raises:
        ValueError: wrong shape, or a row whose argmax is NaN / ``-inf`` (all masked).
    """
    k = len(draft_ids)
    logits = np.asarray(target_logits)
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(
            f"verify_greedy: target_logits must have shape [K + 1, V] = [{k + 1}, V] for "
            f"{k} draft tokens, got {logits.shape}"
        )
    best = logits.argmax(axis=-1).tolist()
    # np.argmax stops at the first NaN and returns it; an all -inf row has no argmax
    # worth emitting. Reading the K + 1 winners catches both (a few scalar reads: after a
    # model call each numpy call costs tens of microseconds, see sampling.SMALL).
    bad = [i for i, b in enumerate(best) if not logits[i, b] > -np.inf]
    if bad:
        raise ValueError(
            f"verify_greedy: target row(s) {bad} are all-masked (-inf) or contain NaN; "
            "check the target model output and any logit masks"
        )
    n_accepted = next((i for i, (b, x) in enumerate(zip(best, draft_ids)) if b != x), k)
    return n_accepted, best[n_accepted]


def verify_sampled(
    draft_ids: Sequence[int],
    q_probs: np.ndarray | Sequence[np.ndarray] | None,
    p_probs: np.ndarray | Sequence[np.ndarray],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Sampled verification (docs/design.md#the-speculative-step steps 3, 4 and 6).

    For ``i = 0..K-1`` in order: draw ``u ~ U[0, 1)`` and accept ``x_i`` iff
    ``u * q_i(x_i) < p_i(x_i)``, i.e. with probability ``min(1, p_i(x_i) / q_i(x_i))``
    written without a division: it never accepts when ``p_i(x_i) = 0`` and always
    accepts when ``p_i(x_i) >= q_i(x_i)`` (in particular when ``p == q``; a draft token
    with ``q_i(x_i) = 0``, which a correct draft never proposes, counts as ratio
    ``+inf``). On the first rejection return ``(i, y)`` with ``y ~ residual(p_i, q_i)``;
    if all K are accepted return ``(K, y)`` with the bonus ``y ~ p_K`` (step 4; rows
    are 0-based here, so ``p_K`` is ``p_{K+1}`` of docs/design.md#the-speculative-step).

    ``q_probs=None`` means model-free drafts (prompt lookup / n-gram, step 6): ``q_i`` is
    one-hot at ``x_i``, so acceptance has probability ``p_i(x_i)`` and the residual is
    ``p_i`` with ``x_i`` removed and renormalised. That is computed directly, without
    building one-hot rows, and gives bit-identical results to passing them explicitly.

    Random numbers: exactly one ``rng.random()`` per examined draft token plus one for
    the emitted sample, i.e. ``n_accepted + 2`` draws after a rejection and ``K + 1``
    when everything is accepted.

    Args:
        draft_ids: the K drafted tokens (K may be 0: just samples from ``p_probs[0]``).
        q_probs: processed draft probabilities, shape ``[K, V]`` or K rows (dense, or
            SparseProbs), or None (one-hot).
        p_probs: processed target probabilities, shape ``[K + 1, V]`` or K + 1 rows
            (dense, or SparseProbs). Rows are read in order and only as far as needed (a
            sequence may compute each when first read: after a rejection at ``i`` the rows
            after it are unused).
        rng: the generator the whole decode loop shares.

    Returns:
        ``(n_accepted, next_token)``; the step emits ``draft_ids[:n_accepted] + [next_token]``.

    Raises:
        ValueError: shapes that do not match ``K``, or a draft id outside ``[0, V)``.
    """
    k = len(draft_ids)
    vocab = _width(p_probs[0]) if len(p_probs) else None
    if len(p_probs) != k + 1 or vocab is None:
        raise ValueError(
            f"verify_sampled: p_probs must have shape [K + 1, V] = [{k + 1}, V] for {k} "
            f"draft tokens, got {len(p_probs)} rows of width {vocab}"
        )
    if q_probs is not None and (len(q_probs) != k
                                or any(_width(row) != vocab for row in q_probs)):
        raise ValueError(
            f"verify_sampled: q_probs must have shape [K, V] = [{k}, {vocab}], got "
            f"{len(q_probs)} rows of widths {[_width(row) for row in q_probs]}"
        )

    for i, tok in enumerate(draft_ids):
        x = int(tok)
        if not 0 <= x < vocab:
            # A negative id would silently index from the end of the row.
            raise ValueError(
                f"verify_sampled: draft token {x} at position {i} is not in [0, {vocab})"
            )
        p_x = _at(p_probs[i], x)
        q_x = 1.0 if q_probs is None else _at(q_probs[i], x)
        if rng.random() * q_x < p_x:
            continue
        if q_probs is None:
            resid = _residual_one_hot(p_probs[i], x)
        else:
            resid = residual(p_probs[i], q_probs[i])
        return i, sample(resid, rng)
    return k, sample(p_probs[k], rng)


def _residual_one_hot(p: np.ndarray | SparseProbs, x: int) -> np.ndarray | SparseProbs:
    """``residual(p, onehot(x))`` without the one-hot row (docs/design.md#the-speculative-step step
    6).

    ``max(0, p - e_x)`` is ``p`` everywhere except 0 at ``x``; same arithmetic as
    :func:`residual`, so the two agree bit for bit.
    """
    if isinstance(p, SparseProbs):
        r = p.p.copy()
        r[p.ids == x] = 0.0
    else:
        p = np.asarray(p, dtype=np.float64)
        r = p.copy()
        r[x] = 0.0
    return _normalised(r, p)


def _normalised(r: np.ndarray, p: np.ndarray | SparseProbs) -> np.ndarray | SparseProbs:
    """``r / sum(r)`` in place, in p's form (dense, or on p's support); ``p`` itself when
    ``r`` has no mass (no rejection can happen then)."""
    mass = r.sum()
    if not mass > 0:
        return p
    r /= mass
    return SparseProbs(p.ids, r, p.vocab) if isinstance(p, SparseProbs) else r


def _width(row: np.ndarray | SparseProbs) -> int | None:
    """V of a probability row, or None when it is not one row."""
    if isinstance(row, SparseProbs):
        return row.vocab
    shape = np.shape(row)
    return shape[0] if len(shape) == 1 else None


def _at(row: np.ndarray | SparseProbs, x: int) -> float:
    return float(row.at(x)) if isinstance(row, SparseProbs) else row[x]
