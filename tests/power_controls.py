"""Verifiers wrong on purpose: the power controls of the distribution tests, which must
reject them at the N, seeds and alpha they use for the right one."""

from __future__ import annotations

from specedge.runtime.probs import sample


def resamples_from_p(draft_ids, q_probs, p_probs, rng):
    """WRONG on purpose: verify_sampled's acceptance test, but a rejected draft is replaced
    by a draw from p_i instead of the residual norm(max(0, p_i - q_i)), the usual mistake in
    speculative sampling. Only the token that replaces a rejected draft is off."""
    def at(row, x):
        return float(row.at(x)) if hasattr(row, "at") else float(row[x])

    for i, x in enumerate(draft_ids):
        q_x = 1.0 if q_probs is None else at(q_probs[i], x)
        if rng.random() * q_x < at(p_probs[i], x):
            continue
        return i, sample(p_probs[i], rng)
    return len(draft_ids), sample(p_probs[len(draft_ids)], rng)
