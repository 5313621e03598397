"""Fixtures of the peers' tests (test_ort_genai.py, test_openvino_genai.py): an empty
specedge cache, and a stand-in checkpoint folder for the cache keys of the peers' models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty specedge cache for the test."""
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A stand-in checkpoint folder: what the cache key reads is its files' names, sizes and
    times."""
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder
