#!/usr/bin/env bash
# Build llama-cpp-python into .venv so that `specedge bench` also measures llama.cpp on the
# Q4_1 GGUF. It compiles llama.cpp from the PyPI sdist (about 15 minutes on 2 cores), so it
# is not an extra. Native CPU tuning is off (on some CPUs it makes multi-token batches
# crash, docs/bench.md#building-llama-cpp-python); the x86 features this CPU reports are switched
# on one by one instead, AVX-512 and its extensions and AVX-VNNI included, so that llama.cpp
# runs with every instruction set this CPU has, as a user's own build would.
#
#   bash scripts/install_llama_cpp.sh [--dry-run]
#
# --dry-run prints the CMake options and builds nothing. The CPU flags are read from
# /proc/cpuinfo, or from the file named by CPUINFO.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=$(grep -m1 '^flags' "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)
on() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
all_on() {  # ON when the CPU reports every one of the flags given
    local f
    for f in "$@"; do [[ $(on "$f") == ON ]] || { echo OFF; return; }; done
    echo ON
}
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw, so it needs
# all five; its extensions (VBMI, VNNI, BF16) are used only with it.
avx512=$(all_on avx512f avx512cd avx512vl avx512dq avx512bw)
args="-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma)"
args="$args -DGGML_F16C=$(on f16c) -DGGML_BMI2=$(on bmi2) -DGGML_AVX512=$avx512"
args="$args -DGGML_AVX512_VBMI=$(all_on avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi)"
args="$args -DGGML_AVX512_VNNI=$(all_on avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni)"
args="$args -DGGML_AVX512_BF16=$(all_on avx512f avx512cd avx512vl avx512dq avx512bw avx512_bf16)"
args="$args -DGGML_AVX_VNNI=$(all_on avx2 avx_vnni)"
if [[ "${1:-}" == "--dry-run" ]]; then
    echo "CMAKE_ARGS=$args"
    exit 0
fi
. .venv/bin/activate
if python -c "import llama_cpp" 2>/dev/null; then  # pip would keep it and build nothing
    python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'is already \
installed, built with:', llama_cpp.llama_print_system_info().decode().strip())"
    echo "to rebuild it with CMAKE_ARGS=$args: pip uninstall -y llama-cpp-python, then run" \
         "this script again" >&2
    exit 0
fi
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
