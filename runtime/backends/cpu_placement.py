"""One core for each ONNX Runtime thread of a run while the threads spin.

A run's intra-op work is split between the thread that calls `run` and the pool's workers,
and every operator ends at a barrier where the caller waits for the workers' blocks. With
spinning on (docs/design.md#threads) the waiting thread busy-waits on its core, so when
a worker and the caller end up on one core (the scheduler may wake a thread on the core of
the thread that woke it, and the caller wakes the workers) the two share it for the whole
run while the other core idles: the run takes the time of one thread and more (in
`specedge serve --max-batch 4` on 2 cores, 2-4 of 360 four-row calls took 2.5x their
median: docs/design.md#threads). ONNX Runtime pins its workers itself only when it picks
the thread count, and never the calling thread.

So while the threads spin, the workers are pinned (ONNX Runtime's
`session.intra_op_thread_affinities`) on one core each and the calling thread is held on
another for the length of each run (`run_placed`), then given back its own set: the calling
thread is the application's (a request's thread in `specedge serve`), pinned only while
it is inside ONNX Runtime. With spinning off the waiting thread sleeps, the scheduler
moves the threads apart, and nothing is pinned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CPU_SYSFS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Placement:
    """`threads` intra-op threads: the calling thread on CPU `caller` (0-based, as the OS
    numbers them) and the workers on `workers` (ONNX Runtime's affinity string: 1-based
    logical processor ids, one worker a `;`)."""

    threads: int
    caller: int
    workers: str


def core_of(cpu: int, sysfs: Path = CPU_SYSFS) -> tuple[int, int]:
    """(package, core) of a logical CPU; CPUs of one core are its hyperthreads. A CPU
    whose topology cannot be read counts as a core of its own."""
    topology = sysfs / f"cpu{cpu}" / "topology"
    try:
        return (int((topology / "physical_package_id").read_text()),
                int((topology / "core_id").read_text()))
    except (OSError, ValueError):
        return (-1, cpu)


def cpu_placement(threads: int | None, allowed: set[int] | None = None,
                  sysfs: Path = CPU_SYSFS) -> Placement | None:
    """Where `threads` intra-op threads go (None: one per physical core of the CPUs this
    process may run on, ONNX Runtime's own count): one CPU of each core, in the OS's order.
    None where there is nothing to place (one thread), more threads than cores (they
    share cores anyway), or the OS has no thread affinity (not Linux)."""
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        allowed = os.sched_getaffinity(0)
    first_of_core: dict[tuple[int, int], int] = {}
    for cpu in sorted(allowed):
        first_of_core.setdefault(core_of(cpu, sysfs), cpu)
    cores = sorted(first_of_core.values())
    n = threads or len(cores)
    if n < 2 or n > len(cores):
        return None
    return Placement(threads=n, caller=cores[0],
                     workers=";".join(str(cpu + 1) for cpu in cores[1:n]))


def run_placed(session, io, placement: Placement | None) -> None:
    """`session.run_with_iobinding(io)`, the calling thread on `placement.caller` for the
    length of the run and back on its own CPUs after (module docstring)."""
    if placement is None:
        session.run_with_iobinding(io)
        return
    own = os.sched_getaffinity(0)  # pid 0: this thread, not the process
    try:
        os.sched_setaffinity(0, {placement.caller})
    except OSError:  # the CPU left this thread's set (a cgroup changed): run where it is
        session.run_with_iobinding(io)
        return
    try:
        session.run_with_iobinding(io)
    finally:
        os.sched_setaffinity(0, own)
