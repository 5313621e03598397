"""How many tokens to draft: a fixed K, or `auto`, which picks the K that maximises the
ideal speedup (DESIGN.md) for the acceptance rate and cost ratio measured so far (beta =
accepted / examined drafts, see stats.py):

    speedup(K) = (1 - beta^(K+1)) / ((1 - beta)(1 + cK))

A draft that is often right and cheap (beta high, c low) earns a long K; a poor or costly
one is cut down to K = 1. K follows measured times, so with `auto` a seed fixes the
distribution but not the exact text of a sampled generation.
"""

from __future__ import annotations

from .stats import StepClock, ideal_speedup

AUTO_MAX_K = 8
# Before anything is measured: a few pseudo-observations of a decent draft (beta = 0.7)
# and a small cost, so the first steps draft a moderate K and start measuring.
PRIOR_EXAMINED, PRIOR_ACCEPTED, PRIOR_C = 4.0, 2.8, 0.1


def best_k(beta: float, c: float, k_max: int) -> int:
    """The K in [1, k_max] with the highest ideal speedup (smallest K on ties)."""
    return max(range(1, k_max + 1), key=lambda k: (ideal_speedup(beta, k, c), -k))


def auto_k(clock: StepClock, k_max: int = AUTO_MAX_K) -> int:
    """best_k for the acceptance and cost measured by `clock`, smoothed by the prior."""
    beta = (clock.accepted + PRIOR_ACCEPTED) / (clock.examined + PRIOR_EXAMINED)
    target_calls = clock.calls["target"]
    if clock.draft_calls and target_calls:
        c = (clock.seconds["draft"] / clock.draft_calls) / \
            (clock.seconds["target"] / target_calls)
    else:
        c = PRIOR_C
    return best_k(min(beta, 0.999), c, k_max)
