"""The folder where specedge keeps what it computes once per machine and reuses: the SmolLM2
checkpoint and test bundles (export), compiled GPU sampling kernels, and the one-row probe's
results (one_row.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECEDGE_CACHE, or ~/.cache/specedge."""
    return Path(os.environ.get("SPECEDGE_CACHE") or Path.home() / ".cache" / "specedge")
