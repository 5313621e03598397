"""How much of this process's CPUs other processes use: what `spinning="auto"` decides by
(docs/design.md#threads).

ONNX Runtime's threads that spin while they wait for work save a wake-up at each of the
hundreds of parallel sections of a step, and cost the cores to anything else that wants
them: on a quiet 2-core CPU spinning ran plain int4 decoding 1.3x faster, beside one busy
process 0.9x. So "auto" spins while the CPUs are otherwise idle, and measures that as it
goes: the CPU time all processes spent on this process's CPUs (Linux `/proc/stat`, steal
time included, which is a hypervisor giving the core to another guest) less this
process's own CPU time, over the wall time between two readings. Its own threads' spinning
is its own CPU time, so it does not count.
"""

from __future__ import annotations

import os
import time

# Other processes that use more than this many cores' worth of the CPUs make them busy;
# they are quiet again below QUIET_CORES (two thresholds, so that a load near one of them
# does not flip the setting, and reopen the sessions, at every generation).
BUSY_CORES = 0.25
QUIET_CORES = 0.1
SAMPLE_SECONDS = 0.2      # the first reading, before the sessions are opened
MIN_WINDOW_SECONDS = 0.5  # shorter windows are a few clock ticks: too coarse to judge
# /proc/stat's cpuN fields: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy: all but idle and iowait (guest time is already inside user and nice).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_STAT = "/proc/stat"


def _cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_seconds(cpus: set[int], stat: str = _STAT) -> float | None:
    """Busy seconds of `cpus` since boot, all processes together; None where `stat` (Linux
    /proc/stat) cannot be read."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadMeter:
    """Cores' worth of CPU time that other processes used on this process's CPUs between
    two readings."""

    def __init__(self, stat: str = _STAT) -> None:
        self._stat = stat
        self._cpus = _cpus()
        self._mark()

    def _mark(self) -> None:
        self._wall = time.monotonic()
        self._busy = cpu_seconds(self._cpus, self._stat)
        self._own = _own_seconds()

    @property
    def available(self) -> bool:
        return self._busy is not None

    def elapsed(self) -> float:
        """Seconds since the last reading (or since the meter was made)."""
        return time.monotonic() - self._wall

    def others(self) -> float | None:
        """Cores used by other processes since the last reading, which this one starts
        anew; None where the CPUs' times cannot be read."""
        wall, busy, own = self._wall, self._busy, self._own
        self._mark()
        if busy is None or self._busy is None or self._wall <= wall:
            return None
        used = (self._busy - busy) - (self._own - own)
        return max(0.0, used / (self._wall - wall))


def spin_now(others: float | None, spinning: bool) -> bool:
    """Whether threads should spin, given the cores `others` used lately (None: unknown)
    and whether they spin now: on while the others stay under QUIET_CORES (or, already
    spinning, under BUSY_CORES), off when unknown."""
    if others is None:
        return False
    return others < (BUSY_CORES if spinning else QUIET_CORES)


def first_choice(meter: LoadMeter, seconds: float = SAMPLE_SECONDS) -> bool:
    """Whether to spin from the start: the others' use over the `seconds` since the meter's
    last reading (waiting for the rest of them), against BUSY_CORES (a reading this short
    is a few clock ticks a CPU, too coarse for QUIET_CORES). The caller may work meanwhile:
    the meter counts this process's own CPU time apart."""
    if not meter.available:
        return False
    time.sleep(max(0.0, seconds - meter.elapsed()))
    return spin_now(meter.others(), spinning=True)
