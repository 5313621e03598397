"""Logit processing and single-draw sampling for the speculative loop.

Both the draft and the target go through :func:`process_logits` with the *same* settings,
so that the acceptance test of DESIGN.md "The speculative step" (step 3) compares two
distributions p and q over one processed space. The warper order is Hugging Face's:
temperature, then top-k, then top-p. Greedy decoding (temperature 0) never comes here;
callers take ``argmax`` directly (DESIGN step 5).

Everything is float64 numpy, vectorised over rows (the target verifies K+1 positions at
once, so a call sees up to ~9 rows of a ~49k vocabulary).
"""

from __future__ import annotations

import numpy as np

__all__ = ["process_logits", "sample"]


def process_logits(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """Turn raw logits into the processed distribution that speculative sampling uses.

    Applies, in Hugging Face's warper order (DESIGN "Notation"):

    1. temperature: ``l / T`` (``T > 0``; greedy is the caller's job);
    2. top-k: drop tokens with ``l < kth_largest(l)`` (HF ``TopKLogitsWarper``; ties at
       the k-th value are kept, ``top_k = 0`` or ``top_k >= V`` disables);
    3. top-p: sort ascending, ``c_j = cumsum(softmax(l_sorted))_j``, drop tokens with
       ``c_j <= 1 - top_p`` but always keep the most probable one (HF
       ``TopPLogitsWarper``; ``top_p = 1.0`` disables);

    then ``softmax`` over the survivors. Tokens whose logit is ``-inf`` are masked
    (probability exactly 0) and stay masked. Ties are broken by token id (a stable sort),
    where HF's ``torch.sort`` leaves them unspecified.

    Cost per row of V logits: O(V) without top-p (``np.partition`` for top-k, no sort);
    with top-p, a threshold pass plus a sort of the few hundred most probable tokens for
    typical LM distributions (see :func:`_mask_top_p_dense`), a full sort only for very
    flat ones.

    Args:
        logits: shape ``[V]`` or ``[N, V]``, any float dtype.
        temperature: strictly positive.
        top_k: number of tokens to keep, 0 to disable.
        top_p: nucleus mass in ``[0, 1]``; 1.0 disables, 0 keeps only the argmax.

    Returns:
        float64 probabilities with the shape of ``logits``; each row sums to 1.

    Raises:
        ValueError: bad settings, or a row with no finite logit / a NaN / a ``+inf``.
    """
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"process_logits: expected logits of shape [V] or [N, V], got {x.shape}")
    if not temperature > 0:
        raise ValueError(
            f"process_logits: temperature must be > 0, got {temperature!r} "
            "(use argmax for greedy decoding)"
        )
    if top_k < 0:
        raise ValueError(f"process_logits: top_k must be >= 0 (0 disables), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"process_logits: top_p must be in [0, 1], got {top_p!r}")

    rows = np.array(x, dtype=np.float64, ndmin=2)  # always a fresh float64 copy
    row_max = rows.max(axis=-1, keepdims=True)
    # np.max propagates NaN, so one reduction tells whether every row is usable: a finite
    # max means no NaN, no +inf and at least one unmasked token.
    if not np.isfinite(row_max).all():
        raise _invalid_rows_error(rows)

    # Shift by the row max *before* dividing by T: softmax, top-k and top-p are all
    # shift-invariant, and (l - max) / T <= 0 cannot overflow to +inf even for tiny T
    # (it may underflow to -inf, which is just a zero-probability token).
    rows -= row_max
    with np.errstate(over="ignore"):  # overflow here is the intended -inf
        rows /= temperature

    vocab = rows.shape[-1]
    if 0 < top_k < vocab:
        rows = _mask_top_k(rows, top_k)
    if top_p < 1.0:
        rows = _mask_top_p(rows, top_p)
    return _softmax(rows).reshape(x.shape)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a 1-D probability vector, using exactly one uniform.

    Inverse CDF: with ``c = cumsum(p)`` and ``t = u * c[-1]``, ``u ~ U[0, 1)``, return the
    first ``i`` with ``c[i] > t``. Token ``i`` owns the interval ``[c[i-1], c[i])``, whose
    length is ``p[i]``, so a zero-probability token owns an empty interval and can never
    be drawn. Scaling by ``c[-1]`` means ``probs`` need not be exactly normalised.

    Args:
        probs: shape ``[V]``, non-negative, positive total.
        rng: consumed by exactly one ``rng.random()`` call (reproducibility of the loop).

    Returns:
        The sampled token id.

    Raises:
        ValueError: wrong shape, or a total that is not positive and finite.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.shape[0] == 0:
        raise ValueError(f"sample: expected a 1-D probability vector, got shape {p.shape}")
    # After top-k / top-p most entries are 0. Adding 0.0 leaves a float sum unchanged, so the
    # cumulative sums over the nonzero entries are those of the whole row, and the first
    # index past u * total is the same token: walk only those (same result, bit for bit).
    support = np.flatnonzero(p)
    if 2 * support.size < p.shape[0]:
        p = p[support]
    else:
        support = None
    cdf = np.cumsum(p)
    total = cdf[-1] if cdf.size else 0.0
    if not (np.isfinite(total) and total > 0):
        raise ValueError(
            f"sample: probabilities must be finite with a positive total, got total {total!r}"
        )
    u = rng.random()
    idx = int(np.searchsorted(cdf, u * total, side="right"))
    if idx >= p.shape[0]:
        # Unreachable as far as we know: u < 1 makes u * c[-1] < c[-1] in floating point
        # too. Cheap insurance all the same; p[V-1] may be 0, so clamp to the last token
        # that can actually be drawn, never to a blind V - 1.
        idx = int(np.flatnonzero(p > 0)[-1])
    return idx if support is None else int(support[idx])


def _mask_top_k(rows: np.ndarray, k: int) -> np.ndarray:
    """HF top-k: set ``l < kth_largest(l)`` to ``-inf`` (ties at the boundary survive).

    ``np.partition`` finds the k-th largest in O(V) per row instead of a full sort.
    """
    vocab = rows.shape[-1]
    unmasked = rows > -np.inf
    counts = unmasked.sum(axis=-1)
    if counts.max() <= k:
        return rows
    if counts.max() <= vocab // 2:
        # numpy's introselect degrades badly on a long run of equal values (a mostly
        # masked row is one: ~10x slower), so select among the unmasked entries only.
        cand, _, _, _ = _compact(rows, unmasked)
    else:
        cand = rows
    width = cand.shape[-1]
    kth = np.partition(cand, width - k, axis=-1)[:, width - k, None]
    return np.where(rows >= kth, rows, -np.inf)


def _mask_top_p(rows: np.ndarray, top_p: float) -> np.ndarray:
    """HF top-p; mostly masked rows (a draft head over part of the vocabulary, or after
    top-k) are first compacted to their unmasked entries, in vocabulary order, since
    ``np.partition`` is ~10x slower on the long run of equal ``-inf`` values."""
    unmasked = rows > -np.inf
    if unmasked.sum(axis=-1).max() > rows.shape[-1] // 2:
        return _mask_top_p_dense(rows, top_p)
    cand, rr, cc, pos = _compact(rows, unmasked)
    kept = _mask_top_p_dense(cand, top_p)
    out = np.full(rows.shape, -np.inf, dtype=rows.dtype)
    out[rr, cc] = kept[rr, pos]
    return out


def _mask_top_p_dense(rows: np.ndarray, top_p: float) -> np.ndarray:
    """HF top-p on ``rows`` (already temperature-scaled and top-k-masked).

    HF sorts ascending and drops token ``j`` when ``c_asc(j) <= 1 - top_p``, keeping at
    least the most probable token. Since ``c_asc(j) = 1 - e(j)``, where ``e(j)`` is the
    mass of the tokens ranked strictly above ``j``, this is the same as keeping ``j``
    iff ``e(j) < top_p`` (plus the top token), which only needs the highest-ranked
    tokens: once a candidate set of top tokens holds mass ``>= top_p``, every token
    outside it has ``e >= top_p`` and is dropped. The candidates are the tokens with
    ``p >= (1 - top_p) / V``: the others, fewer than V, hold less than ``1 - top_p``
    together, so the candidates hold more than ``top_p``. For LM distributions they are a
    few hundred tokens, which are then sorted; a flat row falls back to sorting them all.

    Ranking is by logit with ties in vocabulary order, exactly a stable ascending sort
    of the whole row (HF's ``torch.sort`` leaves the order of ties unspecified): the
    candidates are chosen by value, so they never split a tie.
    """
    vocab = rows.shape[-1]
    probs = _softmax_dense(rows)
    unmasked = rows > -np.inf
    width = int(unmasked.sum(axis=-1).max())
    cand = probs >= (1.0 - top_p) / vocab
    if 4 * int(cand.sum(axis=-1).max()) < width:
        keep, covered = _nucleus(rows, probs, cand & unmasked, top_p)
        if covered.all():  # always, up to rounding in the sums
            return np.where(keep, rows, -np.inf)
    keep, _ = _nucleus(rows, probs, None if width == vocab else unmasked, top_p)
    return np.where(keep, rows, -np.inf)


def _nucleus(
    rows: np.ndarray, probs: np.ndarray, cand_mask: np.ndarray | None, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """Top-p keep mask computed over the candidate tokens ``cand_mask`` (None: all).

    Returns ``(keep [N, V], covered [N])``; ``keep`` is exact for rows where ``covered``
    (the candidates hold mass ``>= top_p``, so everything outside is dropped anyway).
    """
    if cand_mask is None:
        cand, cand_probs = rows, probs
    else:
        cand, rr, cc, pos = _compact(rows, cand_mask)
        cand_probs = np.zeros_like(cand)
        cand_probs[rr, pos] = probs[rr, cc]
    # Descending rank = reversed stable ascending sort, so equal logits rank exactly as
    # in HF's ascending formulation; -inf padding sorts last with probability 0.
    desc = np.argsort(cand, axis=-1, kind="stable")[:, ::-1]
    mass_incl = np.cumsum(np.take_along_axis(cand_probs, desc, axis=-1), axis=-1)
    mass_above = np.zeros_like(mass_incl)
    mass_above[:, 1:] = mass_incl[:, :-1]
    keep_sorted = mass_above < top_p
    keep_sorted[:, 0] = True  # min_tokens_to_keep = 1: the argmax always survives
    keep_cand = np.empty_like(keep_sorted)
    np.put_along_axis(keep_cand, desc, keep_sorted, axis=-1)
    if cand_mask is None:
        keep = keep_cand
    else:
        keep = np.zeros(rows.shape, dtype=bool)
        keep[rr, cc] = keep_cand[rr, pos]
    return keep, mass_incl[:, -1] >= top_p


def _compact(
    rows: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gather the ``mask``-selected entries of each row, in vocabulary order.

    Returns ``(cand, rr, cc, pos)``: ``cand`` is ``[N, max selected]`` padded with
    ``-inf``, and ``cand[rr, pos] == rows[rr, cc]`` for every selected entry.
    """
    rr, cc = np.nonzero(mask)  # row-major, so columns ascend within each row
    counts = np.bincount(rr, minlength=rows.shape[0])
    starts = np.cumsum(counts) - counts
    pos = np.arange(rr.size) - starts[rr]
    cand = np.full((rows.shape[0], int(counts.max())), -np.inf)
    cand[rr, pos] = rows[rr, cc]
    return cand, rr, cc, pos


def _softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise ``exp(l - max l) / sum exp(l - max l)``; ``-inf`` maps to exactly 0.

    Callers guarantee a finite max per row, so no ``-inf - -inf`` NaN can appear. After
    top-k / top-p a row keeps a few hundred of ~49k tokens: the exp then runs over those
    only (an exp pass over the whole row was a quarter of the sampled step's host time).
    """
    unmasked = rows > -np.inf
    if 4 * int(unmasked.sum(axis=-1).max()) < rows.shape[-1]:
        cand, rr, cc, pos = _compact(rows, unmasked)
        out = np.zeros_like(rows)
        out[rr, cc] = _softmax_dense(cand)[rr, pos]
        return out
    return _softmax_dense(rows)


def _softmax_dense(rows: np.ndarray) -> np.ndarray:
    # In place on one fresh array: a temporary of a 49k-wide row costs more in page faults
    # than the exp itself.
    e = rows - rows.max(axis=-1, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _invalid_rows_error(rows: np.ndarray) -> ValueError:
    """Build a ValueError naming the offending rows and what to look at."""
    has_nan = np.isnan(rows).any(axis=-1)
    has_posinf = np.isposinf(rows).any(axis=-1)
    all_masked = ~np.isfinite(rows).any(axis=-1) & ~has_nan & ~has_posinf
    problems = []
    if all_masked.any():
        problems.append(
            f"row(s) {np.flatnonzero(all_masked).tolist()} are all-masked (every logit is "
            "-inf, nothing can be sampled): check banned-token / vocabulary masks and "
            "logits processors"
        )
    if has_nan.any():
        problems.append(
            f"row(s) {np.flatnonzero(has_nan).tolist()} contain NaN: check the model "
            "output (fp16 overflow, uninitialised or stale KV-cache rows)"
        )
    if has_posinf.any():
        problems.append(
            f"row(s) {np.flatnonzero(has_posinf).tolist()} contain +inf: check the model "
            "output for overflow"
        )
    return ValueError("process_logits: invalid logits; " + "; ".join(problems))
