#!/usr/bin/env bash
# Build llama-cpp-python into .venv so that `specedge bench` also measures llama.cpp on the
# Q4_1 GGUF. It compiles llama.cpp from the PyPI sdist (about 15 minutes on 2 cores), so it
# is not an extra. Native CPU tuning is off (on some CPUs it makes multi-token batches
# crash, docs/bench.md#building-llama-cpp-python); the x86 features this CPU reports are switched
# on one by one instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
on() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma)"
args="$args -DGGML_F16C=$(on f16c) -DGGML_BMI2=$(on bmi2) -DGGML_AVX512=OFF"
log=$(mktemp)
echo "building llama-cpp-python with CMAKE_ARGS=$args (log: $log)" >&2
if ! CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        python -m pip install --no-cache-dir --verbose "llama-cpp-python>=0.3,<0.4" 2>&1 |
        tee "$log" | { grep --line-buffered -oE '^\s*\[[0-9]+/[0-9]+\]' >&2 || true; }; then
    tail -30 "$log" >&2
    echo "llama-cpp-python did not build; the full log is $log" >&2
    exit 1
fi
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
