"""Two-sample check of the first two generated tokens, shared by the end-to-end tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chi2_contingency


def first_two_tokens(gen, n: int, seed0: int, prompt_ids=(1, 10, 7), **kwargs) -> Counter:
    """Counts of (t1, t2) over n generations with seeds seed0 .. seed0 + n - 1.

    Three tokens are generated: the loop never drafts into the last slot, so with two the
    second token would always come from a plain step. With three, t2 is the verified first
    draft token, or the residual or bonus draw that replaces it.
    """
    pairs, drafted = Counter(), 0
    for i in range(n):
        out = gen.generate(prompt_ids=list(prompt_ids), max_new_tokens=3, seed=seed0 + i,
                           **kwargs)
        pairs[tuple(out.token_ids[:2])] += 1
        drafted += out.stats["drafted_tokens"]
    if kwargs.get("use_draft", True) and gen.draft is not None:
        assert drafted > 0, "the speculative arm never drafted: it would test plain decoding"
    return pairs


def two_sample_test(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, float,
                                                                         np.ndarray]:
    """Chi-square test of homogeneity; cells rarer than min_count in total are pooled.
    Returns (statistic, p-value, the 2 x cells table)."""
    cells = sorted(set(a) | set(b))
    common = [c for c in cells if a[c] + b[c] >= min_count]
    rare = [c for c in cells if a[c] + b[c] < min_count]
    table = np.array([[a[c] for c in common] + [sum(a[c] for c in rare)],
                      [b[c] for c in common] + [sum(b[c] for c in rare)]])
    table = table[:, table.sum(axis=0) > 0]
    stat, pvalue = chi2_contingency(table)[:2]
    return float(stat), float(pvalue), table


def two_sample_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    return two_sample_test(a, b, min_count)[1]
