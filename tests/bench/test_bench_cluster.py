"""scripts/experiments/bench_cluster.py's pieces that need no cluster: how it names a Ray node's
processes, what it counts as a process's memory, and its memory report."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))

from bench_cluster import process_name, process_rss, table  # noqa: E402


@pytest.mark.parametrize("cmdline, name", [
    (["ray::ServeReplica:specedge:GeneratorReplica"],
     "ray::ServeReplica:specedge:GeneratorReplica"),
    (["ray::ProxyActor more words"], "ray::ProxyActor"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--node_id=x"],
     "raylet"),
    (["/venv/bin/python3.11", "-u", "/venv/ray/_private/log_monitor.py", "--logs-dir=/x"],
     "python log_monitor.py"),
    (["/venv/bin/python", "/venv/bin/ray", "start", "--block"], "python ray"),
    (["/venv/bin/python", "-u", "-m", "specedge.cli", "serve"], "python -m specedge.cli"),
    (["/venv/bin/python"], "python"),
    ([], "?"),
])
def test_process_names(cmdline, name):
    assert process_name(cmdline) == name


def test_a_process_memory_counts_its_children():
    alone = process_rss(psutil.Process().pid)
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = bytearray(80 * 2**20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while psutil.Process(child.pid).memory_info().rss < 80 * 2**20:
            assert time.monotonic() < deadline, "the child did not allocate its memory"
            time.sleep(0.1)
        assert process_rss(psutil.Process().pid) - alone > 70
    finally:
        child.kill()
        child.wait()


def test_the_report_gives_each_node_its_total_and_largest_processes():
    results = {"bundle": "/b/smollm2", "threads": 1, "machine": {"cpu": "cpu"}, "prompts": 4,
               "max_tokens": 32, "rounds": 1, "systems": {}, "ratios": [],
               "memory_mib": {"idle": {"head": {"raylet": 35.0, "gcs_server": 55.0},
                                       "worker": {"raylet": 33.0}},
                              "ray x1": {"driver": {"specedge serve --ray": 210.4}}}}
    lines = table(results).splitlines()
    assert "| idle | head | 90 | gcs_server 55, raylet 35 |" in lines
    assert "| idle | worker | 33 | raylet 33 |" in lines
    assert "| ray x1 | driver | 210 | specedge serve --ray 210 |" in lines
