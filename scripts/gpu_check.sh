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
# It runs `python -m specedge.gpu_check` from the checkout's root, which finds specedge/ there
# and the folders installed as specedge.runtime, .export, ... through the checkout's editable
# install (pip install -e ., as scripts/test.sh installs it); with .venv's Python if there is
# one, else $PYTHON or python3. Without a GPU every part is
# "not run" and the exit status is 0; it is 1 when a part that ran failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec "$PY" -m specedge.gpu_check --out "${1:-gpu_report.json}" "${@:2}"
