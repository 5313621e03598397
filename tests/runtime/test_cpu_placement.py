"""Where spinning ONNX Runtime threads run (runtime/backends/cpu_placement.py): one CPU of
each physical core, the workers pinned by the session and the calling thread for the length
of a run only, given back its own CPUs after, whatever the run does."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from specedge.runtime.backends.cpu_placement import (
    Placement,
    core_of,
    cpu_placement,
    run_placed,
)

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="thread affinity is a Linux call")


def fake_sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    """/sys/devices/system/cpu with each CPU's (package, core)."""
    for cpu, (package, core) in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_one_cpu_of_each_core_with_hyperthreads(tmp_path):
    # Two cores of two hyperthreads each, numbered as Linux often does: 0 and 2 share a core.
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    expected = Placement(threads=2, caller=0, workers="2")  # ONNX Runtime counts from 1
    assert cpu_placement(None, {0, 1, 2, 3}, sysfs) == expected
    assert cpu_placement(2, {0, 1, 2, 3}, sysfs) == expected
    # More threads than cores share cores anyway; one thread has nothing to place.
    assert cpu_placement(3, {0, 1, 2, 3}, sysfs) is None
    assert cpu_placement(1, {0, 1, 2, 3}, sysfs) is None


def test_only_the_cpus_the_process_may_use(tmp_path):
    sysfs = fake_sysfs(tmp_path, {c: (c // 4, c % 4) for c in range(8)})
    assert cpu_placement(None, {5, 6, 7}, sysfs) == Placement(3, caller=5, workers="7;8")
    assert cpu_placement(2, {2, 5, 6}, sysfs) == Placement(2, caller=2, workers="6")
    # Two packages: core 0 of each is a core of its own.
    assert cpu_placement(2, {0, 4}, sysfs) == Placement(2, caller=0, workers="5")


def test_a_cpu_without_topology_counts_as_a_core(tmp_path):
    assert core_of(3, tmp_path) == (-1, 3)
    assert cpu_placement(None, {0, 1, 2}, tmp_path) == Placement(3, caller=0, workers="2;3")


class RecordingSession:
    """Stands in for an ONNX Runtime session: records the CPUs of the thread that runs."""

    def __init__(self, fail: bool = False):
        self.fail, self.seen = fail, []

    def run_with_iobinding(self, io) -> None:
        self.seen.append(os.sched_getaffinity(0))
        if self.fail:
            raise RuntimeError("the run failed")


def on_a_thread(fn) -> None:
    """Run `fn` on a new thread (affinity is per thread: the test's own stays as it is)."""
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@linux_only
def test_the_caller_runs_on_its_cpu_and_gets_its_own_back():
    own = os.sched_getaffinity(0)
    cpu = max(own)
    session = RecordingSession()

    def check():
        before = os.sched_getaffinity(0)
        run_placed(session, None, Placement(2, caller=cpu, workers="1"))
        assert session.seen == [{cpu}]
        assert os.sched_getaffinity(0) == before

    on_a_thread(check)
    assert os.sched_getaffinity(0) == own  # the other threads never moved


@linux_only
def test_a_failed_run_gives_the_cpus_back():
    session = RecordingSession(fail=True)
    cpu = min(os.sched_getaffinity(0))

    def check():
        before = os.sched_getaffinity(0)
        with pytest.raises(RuntimeError, match="the run failed"):
            run_placed(session, None, Placement(2, caller=cpu, workers="1"))
        assert session.seen == [{cpu}]
        assert os.sched_getaffinity(0) == before

    on_a_thread(check)


@linux_only
def test_a_cpu_the_thread_may_not_use_runs_where_it_is():
    session = RecordingSession()
    own = os.sched_getaffinity(0)
    run_placed(session, None, Placement(2, caller=max(own) + 4096, workers="1"))
    assert session.seen == [own]
    assert os.sched_getaffinity(0) == own


def test_no_placement_runs_as_it_is():
    session = RecordingSession()
    run_placed(session, None, None)
    assert len(session.seen) == 1
