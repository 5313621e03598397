#!/usr/bin/env bash
# The GPU path end to end on a CUDA machine, in well under 8 minutes; writes a JSON report.
#   bash scripts/gpu_check.sh [REPORT.json] [--smollm2-bundle DIR] [--tiny-bundle DIR/tiny-bundle]
# It is `specedge gpu-check` run with this checkout's code. What each part proves when it
# passes (how, and the tolerances: specedge/gpu_check/):
#   sampling_kernels  the CUDA sampling and verification kernels choose what the numpy
#                     reference chooses: the same greedy token, the same sampled distribution
#   device_kv         the device KV cache writes and rolls back rows as the host's, bit for bit
#   device_loop       the device loop (arena, row copies, tokens chosen on the GPU) gives
#                     ort-cpu's greedy tokens and the same sampled distribution
#   ort_cuda          onnxruntime-gpu gives ort-cpu's greedy tokens (fp32; its sessions ask
#                     for use_tf32=0, so MatMuls stay fp32 on compute capability 8.0+ too)
#   tensorrt          engines built here: fp32 gives ort-cpu's greedy tokens; fp16 logits
#                     within tolerance and tokens that leave ort-cpu's only at near ties
# It runs this checkout's code, installed or not (a GPU machine may have the dependencies but
# no network to build an install): the package is laid out in a temporary folder as the wheel
# lays it out, from links to the checkout's folders, and imported from there; with .venv's
# Python if there is one, else $PYTHON or python3. Without a GPU every part is "not run" and
# the exit status is 0; it is 1 when a part that ran failed.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
layout="$(mktemp -d)"
trap 'rm -rf "$layout"' EXIT
mkdir "$layout/specedge"
ln -s "$root"/specedge/* "$layout/specedge/"
for folder in export runtime serve bench; do ln -s "$root/$folder" "$layout/specedge/$folder"; done
"$PY" -c 'import sys; sys.path.insert(0, sys.argv.pop(1))
from specedge.gpu_check.check import main
sys.exit(main())' "$layout" --out "${1:-gpu_report.json}" "${@:2}"
