#!/usr/bin/env bash
# The import rules in pyproject.toml (docs/architecture.md#import-rules), checked by
# import-linter on the package as the wheel lays it out. import-linter finds a package's modules
# by walking the one folder Python imports it from; in the repository, specedge.export,
# specedge.runtime, specedge.serve and specedge.bench live in top-level folders of their own
# (pyproject.toml's package-dir), so the package is first installed, without dependencies, into
# a temporary folder, and checked there. Extra arguments go to lint-imports.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m pip install --quiet --no-deps --no-build-isolation --no-compile --target "$tmp" "$root"
cd "$tmp"  # lint-imports puts the working folder first on the import path
lint-imports --no-cache "$root/pyproject.toml" "$@"
