#!/usr/bin/env bash
# Install specedge (with the serve extra, for `specedge serve` next), export
# SmolLM2-135M-Instruct (int4: its weights come on GGUF's Q4_1 grid, which int4 holds
# exactly; docs/export.md) with the distilled feature draft in
# drafts/ (once; cached; the export ends by measuring the draft on 8 prompts, where auto K
# starts from), and answer a chat prompt with speculative decoding on ONNX Runtime CPU,
# compared with plain decoding: with the defaults (lookup where the text repeats itself, the
# draft elsewhere, K chosen as it runs), then with the draft alone. A second run reuses the
# environment (reinstalled only when pyproject.toml changed) and the bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain in three sentences why the sky is blue."}
STAMP=.venv/.specedge-installed   # pyproject.toml's hash when the environment was installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/specedge ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    . .venv/bin/activate
else
    python3 -m venv .venv
    . .venv/bin/activate
    # pip's and setuptools' notices go to a log, shown only if the install fails.
    if ! { python -m pip install --quiet --upgrade pip &&
           python -m pip install --quiet -e ".[export,serve]"; } > .venv/install.log 2>&1; then
        cat .venv/install.log >&2
        exit 1
    fi
    echo "$WANT" > "$STAMP"
fi
BUNDLE=bundles/smollm2-135m-feature-int4
# stdout: the bundle's summary as JSON, for scripts; the report and progress go to stderr.
specedge export smollm2-135m --draft drafts/smollm2-135m-feature --precision int4 \
    --out "$BUNDLE" --verify > /dev/null
echo
echo "== the default settings: prompt lookup where the text repeats, the draft model elsewhere, K chosen as it runs =="
specedge generate --bundle "$BUNDLE" --prompt "$PROMPT" --max-new-tokens 96 --compare
echo
echo "== the draft model alone (--drafter model) =="
specedge generate --bundle "$BUNDLE" --prompt "$PROMPT" --max-new-tokens 96 --compare \
    --drafter model
