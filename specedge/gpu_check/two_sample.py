"""Two-sample check of the first generated tokens (a chi-square test of homogeneity), shared by
the GPU check and the end-to-end tests. Needs scipy."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chi2_contingency


def first_tokens(gen, n: int, seed0: int, count: int = 2, prompt_ids=(1, 10, 7),
                 stats: list | None = None, **kwargs) -> Counter:
    """Counts of the first `count` generated tokens (as tuples) over n generations with seeds
    seed0 .. seed0 + n - 1; with `stats` a list, each generation's statistics are appended.

    count + 1 tokens are generated: the loop never drafts into the last slot, so with
    `count` tokens the last counted one would always come from a plain step. With
    count + 1, tokens 2 .. count are verified drafts (up to count - 1 of them), or the
    residual or bonus draw that replaces one.
    """
    tuples, drafted = Counter(), 0
    for i in range(n):
        out = gen.generate(prompt_ids=list(prompt_ids), max_new_tokens=count + 1,
                           seed=seed0 + i, **kwargs)
        tuples[tuple(out.token_ids[:count])] += 1
        drafted += out.stats["drafted_tokens"]
        if stats is not None:
            stats.append(out.stats)
    if kwargs.get("use_draft", True) and gen.draft is not None:
        assert drafted > 0, "the speculative arm never drafted: it would test plain decoding"
    return tuples


def first_two_tokens(gen, n: int, seed0: int, prompt_ids=(1, 10, 7), **kwargs) -> Counter:
    """Counts of (t1, t2) over n generations with seeds seed0 .. seed0 + n - 1: t2 is the
    verified first draft token, or the residual or bonus draw that replaces it."""
    return first_tokens(gen, n, seed0, 2, prompt_ids, **kwargs)


def two_sample_test(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, float,
                                                                         np.ndarray]:
    """Chi-square test of homogeneity; cells rarer than min_count in total are pooled.
    Returns (statistic, p-value, the 2 x cells table).

    ValueError when fewer than two cells hold min_count draws: with everything on one
    outcome (a setting that makes the output deterministic) the test has no degree of
    freedom and passes whatever the two samplers do.
    """
    cells = sorted(set(a) | set(b))
    common = [c for c in cells if a[c] + b[c] >= min_count]
    rare = [c for c in cells if a[c] + b[c] < min_count]
    table = np.array([[a[c] for c in common] + [sum(a[c] for c in rare)],
                      [b[c] for c in common] + [sum(b[c] for c in rare)]])
    table = table[:, table.sum(axis=0) > 0]
    if (table.sum(axis=0) >= min_count).sum() < 2:
        raise ValueError(f"two-sample test on {table.sum(axis=0).tolist()} draws per cell: "
                         f"fewer than two outcomes have {min_count} or more, so the test "
                         "cannot tell two samplers apart; choose a prompt and settings with "
                         "more than one likely outcome, or draw more")
    stat, pvalue = chi2_contingency(table)[:2]
    return float(stat), float(pvalue), table
