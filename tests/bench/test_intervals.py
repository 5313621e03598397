"""bench/intervals.py: the confidence interval of a ratio measured over rounds."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from specedge.bench.intervals import ratio_ci


def test_ratio_ci_by_hand():
    # Three rounds: logs of 1, 2 and 4 are 0, ln 2, 2 ln 2; mean ln 2, sd ln 2, t(2) = 4.303.
    r = ratio_ci([1.0, 2.0, 4.0])
    half = 4.303 * math.log(2) / math.sqrt(3)
    assert r["median"] == 2.0 and r["rounds"] == [1.0, 2.0, 4.0]
    assert r["ci95"] == pytest.approx([2 * math.exp(-half), 2 * math.exp(half)])
    # Equal rounds: no spread; one round: no interval.
    assert ratio_ci([1.1, 1.1, 1.1])["ci95"] == pytest.approx([1.1, 1.1])
    assert ratio_ci([0.9])["ci95"] is None
    with pytest.raises(ValueError, match="positive"):
        ratio_ci([1.0, 0.0])
    with pytest.raises(ValueError, match="positive"):
        ratio_ci([])


def test_ratio_ci_uses_the_normal_quantile_past_30_degrees_of_freedom():
    ratios = [1.0, 2.0] * 20  # 40 rounds, 39 degrees of freedom
    sd = statistics.stdev([math.log(r) for r in ratios])
    half = 1.96 * sd / math.sqrt(40)
    centre = math.sqrt(2.0)  # geometric mean of 1 and 2
    assert ratio_ci(ratios)["ci95"] == pytest.approx([centre * math.exp(-half),
                                                      centre * math.exp(half)])


def test_the_serve_bench_uses_the_same_function(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "experiments"))
    import bench_serve

    assert bench_serve.ratio_ci is ratio_ci
