"""Logit processing for the speculative loop: logits to the probability rows it compares and
draws from (runtime/probs.py).

Both the draft and the target go through :func:`process_logits` with the *same* settings,
so that the acceptance test of docs/design.md#the-speculative-step (step 3) compares two
distributions p and q over one processed space. The warper order is Hugging Face's:
temperature, then top-k, then top-p. Greedy decoding (temperature 0) never comes here;
callers take ``argmax`` directly (docs/design.md#the-speculative-step step 5).

Probabilities are float64 numpy. A call sees up to ~9 rows of a ~49k vocabulary (the
target verifies K+1 positions at once), and the sampled loop spends its host time here, so
top-p reads only the top of each row (:func:`_top_p_support`). The loop takes each row as
its support (:class:`SparseProbs`, from :func:`process_row`): after top-p a row keeps a
handful of tokens (median 2, 90th percentile 11 for SmolLM2 at T 0.7, top-p 0.9), and a
dense float64 row costs a 393 KB allocation that ``probs.sample`` then scans for the support.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate

import numpy as np

from specedge.runtime.probs import SMALL, SparseProbs, as_sparse

__all__ = ["process_logits", "process_row", "process_row_with_checked_settings"]

NARROW = 1.0 / 128  # top-p's first candidates: tokens holding this share of Z or more


def process_logits(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """Turn raw logits into the processed distribution that speculative sampling uses.

    Applies, in Hugging Face's warper order (docs/design.md#notation):

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
    with top-p, a threshold pass, a float32 exp over the tokens with
    ``(l - max) / T >= ln(1e-6 / V)`` and a sort of the few hundred most probable ones for
    typical LM distributions (see :func:`_top_p_support`), a full sort only for very flat
    ones.

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
    rows = _as_rows(x)
    _check_settings(temperature, top_k, top_p)
    return _processed(rows, _row_maxima(rows), temperature, top_k, top_p).reshape(x.shape)


def process_row(logits: np.ndarray, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> SparseProbs:
    """:func:`process_logits` of one row ``[V]``, as its support: the loop's form.

    Same probabilities, bit for bit; top-p alone never builds the dense row. Checks the
    settings as :func:`process_logits` does; settings checked already (a config's
    ``Sampling``) go to :func:`process_row_with_checked_settings`.
    """
    rows = _one_row(logits)
    _check_settings(temperature, top_k, top_p)
    return _row_support(rows, temperature, top_k, top_p)


def process_row_with_checked_settings(logits: np.ndarray, temperature: float, top_k: int,
                                      top_p: float) -> SparseProbs:
    """:func:`process_row` for settings that were checked when they were made
    (``config.Sampling``: ``temperature > 0``, ``top_k >= 0``, ``top_p`` in ``(0, 1]``), so
    that a generation checks them once, not once per row. The logits, which come from a
    model, are still checked."""
    return _row_support(_one_row(logits), temperature, top_k, top_p)


def _row_support(rows: np.ndarray, temperature: float, top_k: int,
                 top_p: float) -> SparseProbs:
    """One row of checked logits (``[1, V]``, :func:`_one_row`) and checked settings,
    processed, as its support; each case on its fastest path."""
    row_max = _row_maxima(rows)
    vocab = rows.shape[-1]
    if top_p < 1.0 and not 0 < top_k < vocab:
        (ids, p), = _top_p_support(rows, row_max, temperature, top_p)
        return SparseProbs(ids, p, vocab)
    if top_p == 1.0 and not 0 < top_k < vocab:
        return _temperature_row(rows, row_max, temperature)
    if top_p == 1.0 and 4 * top_k < vocab and rows.dtype in (np.float32, np.float16):
        row = _top_k_row(rows, row_max, temperature, top_k)
        if row is not None:
            return row
    return as_sparse(_processed(rows, row_max, temperature, top_k, top_p)[0])


def _processed(rows: np.ndarray, row_max: list[float], temperature: float, top_k: int,
               top_p: float) -> np.ndarray:
    """:func:`process_logits` of checked ``[N, V]`` rows and checked settings: ``[N, V]``
    float64 probabilities."""
    vocab = rows.shape[-1]
    if top_p < 1.0 and not 0 < top_k < vocab:
        # Top-p alone reads only the top of each row: no float64 copy of the whole row.
        return _scatter(_top_p_support(rows, row_max, temperature, top_p), rows.shape)
    # Shift by the row max *before* dividing by T: softmax, top-k and top-p are all
    # shift-invariant, and (l - max) / T <= 0 cannot overflow to +inf even for tiny T
    # (it may underflow to -inf, which is just a zero-probability token).
    scaled = _scaled(rows, np.array(row_max)[:, None], temperature)
    if 0 < top_k < vocab:
        scaled = _mask_top_k(scaled, top_k)
    if top_p < 1.0:
        return _scatter(_top_p_support(scaled, [0.0] * len(scaled), 1.0, top_p), scaled.shape)
    return _softmax(scaled)


def _top_k_row(rows: np.ndarray, row_max: list[float], temperature: float,
               top_k: int) -> SparseProbs | None:
    """:func:`process_row` with temperature and top-k (``4 k < V``) of float32 / float16
    logits, bit for bit, from the k largest logits alone; None where it cannot promise that.

    :func:`process_logits` scales the whole row to float64 and partitions it. For these
    dtypes ``(l - m) / T`` is strictly increasing in ``l``: two logits differ by at least a
    float32 ulp, which scaling keeps apart, unless the k-th largest logit is below
    ``2^-20 |m|`` (then ``l - m`` may round two of them together: left to the full path).
    So top-k's survivors are the logits ``>=`` the k-th largest logit, and their softmax is
    the one :func:`_softmax` computes over the survivors (one row, fewer than a quarter of
    the vocabulary: the same values in the same order). A row with at most ``k`` unmasked
    tokens, or too few survivors, is left to the full path too.
    """
    row, m = rows[0], row_max[0]
    vocab = row.shape[0]
    # introselect slows ~15x on a long run of equal values (a mostly masked row, e.g. a
    # draft that scores part of the vocabulary): select among the unmasked logits then.
    cand = row[row > -np.inf] if 2 * np.count_nonzero(row == -np.inf) > vocab else row
    if cand.size <= top_k:
        return None
    cand = _above_kth(cand, top_k)
    kth = float(np.partition(cand, cand.size - top_k)[cand.size - top_k])
    if not (kth > -np.inf and abs(kth) * 2.0 ** 20 >= abs(m)):
        return None
    ids = np.flatnonzero(row >= kth)
    if 4 * ids.size >= vocab:
        return None
    vals = _scaled(row.take(ids), m, temperature)
    if not vals.min() > -np.inf:  # a tiny T underflowed a survivor: the full path
        return None
    p = _softmax_dense(vals[None])[0]
    kept = p != 0
    return SparseProbs(ids[kept], p[kept], vocab)


def _above_kth(values: np.ndarray, k: int) -> np.ndarray:
    """The values at or above a threshold that at least ``k`` of them reach (so the k largest
    are among them), or ``values`` itself: a partition of the whole row costs 1.2 ms at
    V = 262144, a compare 0.1 ms. The threshold is a high quantile of every 64th value, so
    about 2k + 256 values pass; where fewer than k do, all are kept."""
    stride = 64
    if values.size < 16 * stride or 8 * k > values.size:
        return values
    sample = values[::stride]
    rank = min(sample.size, 2 * k // stride + 4)
    t = sample[np.argpartition(sample, sample.size - rank)[sample.size - rank]]
    above = values[values >= t]
    return above if above.size >= k else values


def _temperature_row(rows: np.ndarray, row_max: list[float],
                     temperature: float) -> SparseProbs:
    """:func:`process_row` with temperature alone (``top_k`` 0, or at least V: no top-k):
    :func:`process_logits`' arithmetic on one fresh float64 row, without its passes that
    change nothing.

    At V = 262144 a pass over a float64 row costs 0.1-0.3 ms and the exp 3.5 ms (AVX2, no
    SIMD exp for float64), so the row's passes are counted: the shifted row's max is exactly
    0 (``(m - m) / T``), so :func:`_softmax_dense`'s shift by it is skipped (``e - 0.0`` is
    ``e``), and a row with no zero probability keeps every id without a scan for its support.
    """
    scaled = _scaled(rows, row_max[0], temperature)
    vocab = scaled.shape[-1]
    if 4 * np.count_nonzero(scaled > -np.inf) < vocab:
        return as_sparse(_softmax(scaled)[0])  # mostly masked: the exp over the rest only
    e = np.exp(scaled, out=scaled)
    e /= e.sum(axis=-1, keepdims=True)
    if not e.min() > 0:
        return as_sparse(e[0])
    return SparseProbs(_every_id(vocab), e[0], vocab)


_EVERY_ID: dict[int, np.ndarray] = {}


def _every_id(vocab: int) -> np.ndarray:
    """``arange(vocab)``, read-only and made once per vocabulary: a full support's ids."""
    if vocab not in _EVERY_ID:
        ids = np.arange(vocab)
        ids.flags.writeable = False
        _EVERY_ID[vocab] = ids
    return _EVERY_ID[vocab]


def _one_row(logits: np.ndarray) -> np.ndarray:
    """One row of logits ``[V]`` as ``[1, V]`` rows (:func:`_as_rows`); ValueError for any
    other shape."""
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"process_row: expected one row of logits [V], got shape {x.shape}")
    return _as_rows(x)


def _as_rows(x: np.ndarray) -> np.ndarray:
    """Logits ``[V]`` or ``[N, V]`` as ``[N, V]`` rows of a float dtype; ValueError for any
    other shape."""
    if x.dtype.kind != "f":
        x = x.astype(np.float64)  # top-p compares in the logits' own dtype
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"process_logits: expected logits of shape [V] or [N, V], got {x.shape}")
    return x.reshape(1, -1) if x.ndim == 1 else x


def _check_settings(temperature: float, top_k: int, top_p: float) -> None:
    """The entry check of :func:`process_logits` and :func:`process_row`, for callers whose
    settings were not checked when they were made."""
    if not temperature > 0:
        raise ValueError(
            f"process_logits: temperature must be > 0, got {temperature!r} "
            "(use argmax for greedy decoding)"
        )
    if top_k < 0:
        raise ValueError(f"process_logits: top_k must be >= 0 (0 disables), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"process_logits: top_p must be in [0, 1], got {top_p!r}")


def _row_maxima(rows: np.ndarray) -> list[float]:
    """Each row's max as a Python float (exactly the float64 of it); ValueError naming the
    rows that have no finite max."""
    row_max = rows.max(axis=-1).tolist()
    # np.max propagates NaN, so one reduction tells whether every row is usable: a finite
    # max means no NaN, no +inf and at least one unmasked token.
    if not all(map(math.isfinite, row_max)):
        raise _invalid_rows_error(rows)
    return row_max


def _scatter(supports: list[tuple[np.ndarray, np.ndarray]], shape: tuple) -> np.ndarray:
    out = np.zeros(shape)
    for i, (ids, p) in enumerate(supports):
        out[i, ids] = p
    return out


def _scaled(logits: np.ndarray, shift: np.ndarray | float, temperature: float) -> np.ndarray:
    """``(l - shift) / T`` in float64, a fresh array."""
    rows = np.subtract(logits, shift, dtype=np.float64)
    with np.errstate(over="ignore"):  # overflow here is the intended -inf
        rows /= temperature
    return rows


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


def _top_p_support(logits: np.ndarray, shift: list[float], temperature: float,
                   top_p: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """HF top-p on ``l = (logits - shift) / T`` (``shift`` the row max, or 0 for rows
    already scaled and top-k-masked), then softmax over the survivors, row by row: each
    row's kept token ids (ascending) and their float64 probabilities.

    HF sorts ascending and drops token ``j`` when ``c_asc(j) <= 1 - top_p``, keeping at
    least the most probable token. Since ``c_asc(j) = 1 - e(j) / Z``, where ``e(j)`` is the
    unnormalised mass ``sum exp(l)`` of the tokens ranked strictly above ``j`` and ``Z`` the
    row's, this keeps ``j`` iff ``e(j) < top_p * Z`` (plus the top token): only the top of
    the ranking and the total ``Z`` are needed. :func:`_nucleus` finds the kept tokens
    from an estimate of ``Z``; the exact ``Z`` costs an exp over the whole row in float64,
    five times a float32 one, so it is computed only for the rare row whose decision the
    estimate cannot settle.
    """
    out = []
    # Z >= 1 (the max is exp(0)), so the tokens with l < deep hold less than 1e-6 of it:
    # bounded, not summed. The rest in float32 (exp, float64 sum): relative error < 1e-6,
    # since rounding l costs |l| * 6e-8 per term and sum p_j |l_j| <= log V; exp adds
    # < 4 ulp. The estimate is thus within 1.5e-6 of Z, a sixth of the tolerance given.
    vocab = logits.shape[-1]
    deep = math.log(1e-6 / vocab)
    for row, m in zip(logits, shift):
        # Every token left out must be below bound. The compare rounds a Python float to the
        # row's dtype (by at most 2^-11 of it, float16), so it is lowered by 2^-9 of it first.
        bound = m + temperature * deep
        above = row >= bound - abs(bound) / 512
        if 2 * np.count_nonzero(above) > vocab:
            # Most of the row (a long flat tail, common at V >= 128k): the whole row, without
            # the scan for the ids and the copy; the tail below bound is then summed, not
            # bounded. Same kept tokens and probabilities (the float64 values are the same).
            ids, vals = _every_id(vocab), _scaled(row, m, temperature)
        else:
            ids = np.flatnonzero(above)
            # take: 3x a boolean mask's speed. No overflow to guard: (l - m) / T >= deep here.
            vals = np.subtract(row.take(ids), m, dtype=np.float64)
            vals /= temperature
        e32 = vals.astype(np.float32)
        estimate = np.exp(e32, out=e32).sum(dtype=np.float64)
        estimate += math.exp(deep) * (vocab - ids.size) / 2  # the tail left out
        kept = _nucleus(vals, vocab, top_p, estimate, 1e-5)
        if kept is None:
            full = _scaled(row, m, temperature)
            ids = np.flatnonzero(full > -np.inf)
            vals = full.take(ids)
            kept = _nucleus(vals, vocab, top_p, np.exp(full).sum(), 0.0)
        e = np.exp(vals[kept])
        out.append((ids[kept], e / e.sum()))
    return out


def _nucleus(vals: np.ndarray, vocab: int, top_p: float, z: float,
             tol: float) -> np.ndarray | list[int] | None:
    """Positions in ``vals`` of the tokens that top-p keeps, ascending, given the logits
    ``vals`` of all the tokens above some bound (in vocabulary order) and ``z`` within
    relative ``tol`` of the row's ``Z``. None when that does not decide (a token's
    ``e(j)``, or the candidates' coverage, within ``tol`` of ``top_p * Z``).

    Candidates are the tokens above a bound, and only they are sorted; every token outside
    them ranks below them all, so if they hold more than ``top_p * Z`` the others are
    dropped (checked, so any bound works). Bounds are tried from few tokens to many: the
    tokens that each hold ``NARROW`` of ``Z`` or more (at most 1 / NARROW; they cover the
    nucleus of ~90% of SmolLM2's rows at T 0.7, top-p 0.9), then ``NARROW^2`` and
    ``NARROW^3`` of ``Z`` (where above the next), then ``exp(l) >= (1 - top_p) Z / V``
    (the others, fewer than V, hold less than ``(1 - top_p) Z``: a few hundred to
    thousands of tokens), then all of ``vals`` for a flat row. Ranking is by logit with ties
    in vocabulary order, exactly a stable ascending sort of the whole row reversed (HF's
    ``torch.sort`` leaves the order of ties unspecified): candidates are chosen by value, so
    they never split a tie.
    """
    t = top_p * z
    wide = math.log((1.0 - top_p) * z / vocab) if top_p < 1.0 else -math.inf
    # Between NARROW and wide, shares NARROW^2 and NARROW^3 of Z: at V = 262144, top-p 0.95,
    # wide takes in most of the row (an argsort of ~100k tokens, 4 ms) where the nucleus is
    # a handful of tokens just short of NARROW's coverage.
    bounds = [b for b in (math.log(NARROW ** n * z) for n in (1, 2, 3)) if b > wide]
    bounds = [*bounds, wide, -math.inf]
    last = len(bounds) - 1
    for i, bound in enumerate(bounds):
        cand = np.flatnonzero(vals >= bound - 2 * tol) if i < last else np.arange(vals.size)
        if not cand.size:
            continue
        # order: positions by rank; above[i]: the mass e(.) of the ranks before i, and
        # above[-1] the candidates' coverage. Few candidates in Python floats (SMALL), many
        # in numpy; the same float64 sums in the same order either way.
        if cand.size <= SMALL:
            ranked = sorted(zip(vals[cand].tolist(), cand.tolist()), reverse=True)
            order = [j for _, j in ranked]
            above = [0.0, *accumulate(math.exp(v) for v, _ in ranked)]
        else:
            order = cand[np.argsort(vals[cand], kind="stable")[::-1]]
            above = np.concatenate(([0.0], np.cumsum(np.exp(vals[order]))))
        if above[-1] >= t * (1 + tol):
            break
        if tol and i == last - 1:
            return None  # coverage undecided, or the given tokens too few
    n = len(order)
    # above ascends, so the kept ranks are a prefix and the values nearest t sit at its end.
    first_out = bisect_left(above, t, 0, n)
    if tol and any(abs(above[i] - t) <= tol * t for i in (first_out - 1, first_out) if 0 < i < n):
        return None
    kept = order[:max(first_out, 1)]  # min_tokens_to_keep = 1: the argmax always survives
    return sorted(kept) if isinstance(kept, list) else np.sort(kept)


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
