"""The peak memory of one export step, so that a manifest says what exporting a model took.

Linux keeps a process's peak resident set size (VmHWM in /proc/self/status) and lets the
process reset it (writing 5 to /proc/self/clear_refs), so each step's peak is measured on its
own, without sampling. Elsewhere the figures are None.
"""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak() -> bool:
    """Start a new peak at the current resident size; False where the system cannot."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_mb() -> float | None:
    """The peak resident size since the last `reset_peak` (or the process start), in MB."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return round(int(found.group(1)) / 1024, 1) if found else None
