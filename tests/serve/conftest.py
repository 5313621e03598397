"""The tiny bundle's server, started once per test module (tests/server_process.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import ServerProcess, run_server


@pytest.fixture(scope="module")
def tiny_server(tiny_bundle, tmp_path_factory) -> Iterator[ServerProcess]:
    """The tiny bundle behind `specedge serve`, with room for 64 waiting requests."""
    with run_server(tiny_bundle, tmp_path_factory.mktemp("serve"), "--max-queue", "64",
                    "--model-name", "tiny") as server:
        yield server
