#!/usr/bin/env bash
# Install specedge, export SmolLM2-135M-Instruct (int4: its weights come on GGUF's Q4_1
# grid, which int4 holds exactly; docs/export.md) with the distilled feature draft in
# drafts/ (once; cached; the export ends by measuring the draft on 8 prompts, where auto K
# starts from), and answer a chat prompt with speculative decoding on ONNX Runtime CPU,
# compared with plain decoding: with the defaults (lookup where the text repeats itself, the
# draft elsewhere, K chosen as it runs), then with the draft alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain in three sentences why the sky is blue."}
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[export]"
BUNDLE=bundles/smollm2-135m-feature-int4
specedge export smollm2-135m --draft drafts/smollm2-135m-feature --precision int4 \
    --out "$BUNDLE" --verify
specedge generate --bundle "$BUNDLE" --prompt "$PROMPT" --max-new-tokens 96 --compare
specedge generate --bundle "$BUNDLE" --prompt "$PROMPT" --max-new-tokens 96 --compare \
    --drafter model
