"""Confidence intervals of speed ratios measured over several rounds.

A speed ratio between two systems measured on one machine moves from run to run by more
than the differences worth reporting (the same comparison gave 1.16x, 1.23x and 1.32x in
three runs of two rounds), so a ratio is quoted with its spread: each round gives one ratio
(both systems measured in that round, taking turns), and the report gives their median and
a 95% confidence interval of their geometric mean, exp(mean ± t(0.975, R-1) * sd / sqrt(R))
of the log ratios over R rounds (Student t, as R is small).
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 past them.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ratio_ci(ratios: list[float]) -> dict:
    """Median of per-round ratios and the 95% confidence interval of their geometric mean,
    exp(mean ± t * sd / sqrt(R)) of the logs (None with one round): a dict with `median`,
    `rounds` (the ratios) and `ci95` ([low, high] or None)."""
    if not ratios or any(not r > 0 for r in ratios):
        raise ValueError(f"ratios must be positive, got {ratios}")
    logs = [math.log(r) for r in ratios]
    out = {"median": statistics.median(ratios), "rounds": [float(r) for r in ratios],
           "ci95": None}
    if len(logs) >= 2:
        t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))
        mean = statistics.fmean(logs)
        out["ci95"] = [math.exp(mean - half), math.exp(mean + half)]
    return out
