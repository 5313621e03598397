"""The tests' shorthand for the two-sample test of specedge/gpu_check/two_sample.py."""

from __future__ import annotations

from collections import Counter

from specedge.gpu_check.two_sample import two_sample_test


def two_sample_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """The p-value of `two_sample_test` on the two samples' counts."""
    return two_sample_test(a, b, min_count)[1]
