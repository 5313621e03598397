#!/usr/bin/env bash
# The GPU path end to end on a CUDA machine, in well under 8 minutes; writes a JSON report.
#   bash scripts/gpu_check.sh [REPORT.json] [--smollm2-bundle DIR] [--tiny-bundle DIR/tiny-bundle]
# What each part proves when it passes (how, and the tolerances: scripts/gpu_check.py):
#   sampling_kernels  the CUDA sampling and verification kernels choose what the numpy
#                     reference chooses: the same greedy token, the same sampled distribution
#   device_kv         the device KV cache writes and rolls back rows as the host's, bit for bit
#   device_loop       the device loop (arena, row copies, tokens chosen on the GPU) gives
#                     ort-cpu's greedy tokens and the same sampled distribution
#   ort_cuda          onnxruntime-gpu gives ort-cpu's greedy tokens (fp32; its sessions ask
#                     for use_tf32=0, so MatMuls stay fp32 on compute capability 8.0+ too)
#   tensorrt          engines built here: fp32 gives ort-cpu's greedy tokens; fp16 logits
#                     within tolerance and tokens that leave ort-cpu's only at near ties
# It runs this checkout's code (installed or not), with .venv's Python if there is one, else
# $PYTHON or python3. Without a GPU every part is "not run" and the exit status is 0; it is 1
# when a part that ran failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
exec "$PY" scripts/gpu_check.py --out "${1:-gpu_report.json}" "${@:2}"
