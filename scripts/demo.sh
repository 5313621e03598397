#!/usr/bin/env bash
# Install specedge, export SmolLM2-135M-Instruct with a draft (once; cached), and answer a
# chat prompt with speculative decoding on ONNX Runtime CPU, compared with plain decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain in three sentences why the sky is blue."}
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[export]"
specedge export smollm2-135m --draft-layers 4 --out bundles/smollm2-135m --verify
specedge generate --bundle bundles/smollm2-135m --prompt "$PROMPT" --max-new-tokens 96 --compare
specedge generate --bundle bundles/smollm2-135m --prompt "$PROMPT" --max-new-tokens 96 \
    --drafter prompt-lookup --compare
