#!/usr/bin/env bash
# The GPU path end to end on a CUDA machine, in well under 8 minutes; writes a JSON report.
#   bash scripts/gpu_check.sh [REPORT.json] [--smollm2-bundle DIR]
# Parts and what each needs: scripts/gpu_check.py. Without a GPU it reports every part as
# "not run" and exits 0; it exits 1 when a part that ran failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import specedge.runtime" 2>/dev/null; then
    # Not installed (a device image, maybe offline, maybe without wheel-building tools):
    # lay the package out as pyproject.toml maps it, with links to this checkout.
    site=$(mktemp -d)
    mkdir "$site/specedge"
    ln -s "$PWD"/specedge/*.py "$site/specedge/"
    for part in runtime export bench; do ln -s "$PWD/$part" "$site/specedge/$part"; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" scripts/gpu_check.py --out "${1:-gpu_report.json}" "${@:2}"
