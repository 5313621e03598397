"""scripts/experiments/bench_startup.py on the tiny bundle: each part of a start is timed
from the process start, and the parts add up to the whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))

import bench_startup  # noqa: E402


def test_startup_parts_add_up(tiny_bundle, tmp_path, capsys):
    out = tmp_path / "startup.json"
    report = bench_startup.main(["--bundle", str(tiny_bundle), "--rounds", "2", "--threads",
                                 "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert len(report["runs"]["generate"]) == len(report["runs"]["serve"]) == 2
    for run in report["runs"]["generate"]:
        assert all(run[part] > 0 for part in ("import_s", "open_s", "first_token_s"))
        assert run["total_s"] == pytest.approx(run["import_s"] + run["open_s"]
                                               + run["first_token_s"])
    for run in report["runs"]["serve"]:
        assert 0 < run["ready_s"] < run["total_s"]
    assert "| serve | ready_s |" in capsys.readouterr().out
