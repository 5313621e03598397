#!/usr/bin/env bash
# Build llama-cpp-python into .venv so that `specedge bench` also measures llama.cpp on the
# Q4_1 GGUF. It compiles llama.cpp from the PyPI sdist (about 15 minutes on 2 cores), so it
# is not an extra. Native CPU tuning is off (on some CPUs it makes multi-token batches
# crash, docs/bench.md#building-llama-cpp-python); the x86 features this CPU reports are switched
# on one by one instead, AVX-512 and its extensions and AVX-VNNI included, so that llama.cpp
# runs with every instruction set this CPU has, as a user's own build would.
#
#   bash scripts/install_llama_cpp.sh [--dry-run | --server]
#
# --dry-run prints the CMake options and builds nothing. --server builds llama.cpp's own
# llama-server instead (parallel slots, continuous batching, its speculative modes), from the
# llama.cpp sources that the same sdist vendors, with the same options, into
# .venv/llama.cpp/bin/llama-server (about 10 minutes on 2 cores); no Web UI, nothing fetched
# but the sdist. The CPU flags are read from
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
# AMX stays off where the CPU has it too: the AMX kernels of the llama.cpp that
# llama-cpp-python 0.3.36 vendors stop on an illegal instruction at the first Q4_1 matrix
# product (a tile instruction after a tile configuration the compiler dropped; llama.cpp
# pull request 26954), so no build with them runs.
if [[ "${1:-}" == "--dry-run" ]]; then
    echo "CMAKE_ARGS=$args"
    exit 0
fi
. .venv/bin/activate
if [[ "${1:-}" == "--server" ]]; then
    out=.venv/llama.cpp/bin
    if [[ -x $out/llama-server ]]; then
        echo "$out/llama-server is already built; remove it to build it again" >&2
        exit 0
    fi
    work=$(mktemp -d)
    python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python>=0.3,<0.4" \
        -d "$work"
    tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
    echo "building llama-server from $src with $args (log: $work/build.log)" >&2
    # shellcheck disable=SC2086  # $args holds several options
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $args -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF > "$work/build.log" 2>&1
    cmake --build "$work/build" --target llama-server -j "$(nproc)" >> "$work/build.log" 2>&1 ||
        { tail -30 "$work/build.log" >&2; exit 1; }
    mkdir -p "$out"
    cp "$work/build/bin/llama-server" "$out/"
    "$out/llama-server" --version
    exit 0
fi
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
