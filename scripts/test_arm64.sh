#!/usr/bin/env bash
# The runtime on aarch64, under QEMU user-mode emulation (docs/devices.md#aarch64-in-ci).
#
# Builds the wheel, makes an arm64 Debian root filesystem (cached between runs), installs the
# wheel there with its runtime, serve and test dependencies from PyPI's aarch64 wheels, and
# runs there, on bundles exported here on x86 beforehand as users do:
#   1. `specedge doctor --bundle` on the recommended SmolLM2 bundle (int4, feature draft);
#   2. tests/arm64/reference_decodes.py: greedy speculative decoding against plain decoding
#      and the token ids decoded here on x86, on fp32 (portable and batched attention), int8
#      and int4 (fused and batched) tiny bundles, and the recommended SmolLM2 int4 bundle on
#      three prompts of 64 tokens; seeded sampled decodes compared with x86's; `specedge
#      serve` answers one greedy chat, plain decoding's text;
#   3. the torch-free runtime and server tests (ARM64_TESTS), on the same x86-exported bundles.
#
# Needs root (binfmt_misc, chroot), Debian's mmdebstrap, qemu-user-static and
# binfmt-support (installed here when missing), and the project's .venv (scripts/test.sh) for
# the x86 side. The root filesystem and its venv live in $SPECEDGE_ARM64_DIR (default
# ~/.cache/specedge/arm64); delete it to start over. Reports land in $SPECEDGE_ARM64_DIR/report.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=$REPO/.venv/bin/python
ARM=${SPECEDGE_ARM64_DIR:-${SPECEDGE_CACHE:-$HOME/.cache/specedge}/arm64}
ROOTFS=$ARM/rootfs
REPORT=$ARM/report
PACKAGES=python3.11,python3.11-venv,ca-certificates,libstdc++6
# The emulated CPU: QEMU's "max" has every instruction set QEMU knows (NEON, dotprod, i8mm,
# bf16, SVE2); ARM64_CPU=cortex-a76 is a Raspberry Pi 5's core (NEON and dotprod, no i8mm).
ARM64_CPU=${ARM64_CPU:-max}
# The runtime and server tests that import no torch and fit the time under emulation (about
# 3 minutes for 674 tests). Left out: tests that export (torch) or need cuda-python, and
# the statistical tests of sampled output (test_exactness.py and the sampled generator
# tests: minutes each under emulation; they run in the main suite).
ARM64_TESTS=${ARM64_TESTS:-"tests/runtime/test_generator.py tests/runtime/test_kv_cache.py
  tests/runtime/test_drafter_protocol.py tests/runtime/test_stop_strings.py
  tests/runtime/test_pieces.py tests/runtime/test_prefix_store.py tests/runtime/test_prompt_reuse.py
  tests/runtime/test_thread_settings.py tests/runtime/test_no_torch.py
  tests/runtime/test_sampling.py tests/runtime/test_auto_k_file.py
  tests/serve/test_server_api.py tests/serve/test_server_batch.py tests/test_doctor.py
  --deselect tests/runtime/test_generator.py::test_speculative_and_plain_sample_the_same_first_tokens
  --deselect tests/runtime/test_drafter_protocol.py::test_the_feature_drafter_is_a_drafter
  --deselect tests/serve/test_server_api.py::test_smollm2_through_the_server"}

started=$SECONDS
step() { echo "== arm64 [$((SECONDS - started)) s] $*"; }

if [ "$(id -u)" != 0 ]; then
    echo "scripts/test_arm64.sh needs root (binfmt_misc, chroot): run it with sudo" >&2
    exit 2
fi
if [ ! -x "$PY" ]; then
    echo "no $PY: run bash scripts/test.sh first (the x86 side exports the bundles)" >&2
    exit 2
fi

step "host tools: mmdebstrap, qemu-user-static, binfmt-support"
if ! command -v mmdebstrap >/dev/null || [ ! -x /usr/bin/qemu-aarch64-static ] \
        || ! command -v update-binfmts >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        mmdebstrap qemu-user-static binfmt-support >/dev/null
fi
# Register QEMU for aarch64 programs, with the F flag (the kernel opens the interpreter now,
# so programs inside the chroot find it without a copy there).
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64
fi
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "qemu-aarch64 is registered without the F flag: reinstall qemu-user-static" >&2
    exit 1
}

step "arm64 root filesystem ($ROOTFS)"
if [ "$(cat "$ROOTFS/.packages" 2>/dev/null)" != "$PACKAGES" ]; then
    rm -rf "$ROOTFS" "$ROOTFS.part"
    mkdir -p "$ARM"
    mmdebstrap --quiet --mode=root --variant=extract --arch=arm64 --include="$PACKAGES" \
        bookworm "$ROOTFS.part"
    echo "$PACKAGES" > "$ROOTFS.part/.packages"
    mv "$ROOTFS.part" "$ROOTFS"
fi
# pip inside reaches PyPI with this machine's name server and certificate authorities.
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
mkdir -p "$ROOTFS/tmp" "$REPORT"

# The x86 side's bundles, tests and wheel go to /work inside. No /proc is mounted there: ONNX
# Runtime's CPU detection crashes under QEMU reading the host's x86 /proc/cpuinfo; without it,
# ONNX Runtime (and `specedge doctor`) read the emulated CPU's instruction sets from the
# kernel's hardware-capability bits (getauxval), which QEMU sets for ARM64_CPU.
WORK=$ROOTFS/work
rm -rf "$WORK"
mkdir -p "$WORK"
in_arm64() {
    env -i HOME=/root PATH=/venv/bin:/usr/bin:/bin LANG=C.UTF-8 QEMU_CPU="$ARM64_CPU" \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 SPECEDGE_TEST_BUNDLES=/work/bundles \
        /usr/sbin/chroot "$ROOTFS" "$@"
}

step "wheel"
rm -rf build
"$PY" -m build --wheel --outdir "$WORK/wheel" . >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
rm -rf build
WHEEL=$(basename "$WORK"/wheel/specedge-*.whl)

step "install the wheel into the arm64 venv (/venv; its dependencies are kept between runs)"
[ -x "$ROOTFS/venv/bin/python" ] || in_arm64 /usr/bin/python3.11 -m venv /venv
in_arm64 /venv/bin/python -m pip install --quiet "/work/wheel/$WHEEL[serve,dev]"
in_arm64 /venv/bin/python -m pip install --quiet --force-reinstall --no-deps "/work/wheel/$WHEEL"
in_arm64 /venv/bin/python -c "import platform, onnxruntime; \
print('python', platform.python_version(), platform.machine(), 'onnxruntime', onnxruntime.__version__)"

step "bundles exported on x86, and their reference decodes"
"$PY" tests/tiny_bundles.py "$WORK/bundles" >"$WORK/export.log" 2>&1 \
    || { cat "$WORK/export.log"; exit 1; }
# SmolLM2 int4: the recommended bundle (feature draft, batched attention by default),
# exported once into the specedge cache.
CACHED=${SPECEDGE_CACHE:-$HOME/.cache/specedge}/bundles
smollm2() {  # NAME EXPORT-ARGUMENTS...: export (or reuse) and copy without auto K's file
    local name=$1
    shift
    "$PY" -m specedge.cli export smollm2-135m --precision int4 "$@" --out "$CACHED/$name" \
        >"$WORK/export-$name.log" 2>&1 || { cat "$WORK/export-$name.log"; exit 1; }
    mkdir "$WORK/bundles/$name"
    for f in "$CACHED/$name"/*; do
        [ "$(basename "$f")" = auto_k.json ] || cp "$f" "$WORK/bundles/$name/"
    done
}
smollm2 smollm2-feature-int4 --draft drafts/smollm2-135m-feature
cp -r tests pyproject.toml "$WORK/"
"$PY" tests/arm64/reference_decodes.py write "$WORK/bundles" "$WORK/reference.json"

step "specedge doctor on aarch64 (QEMU_CPU=$ARM64_CPU)"
in_arm64 /venv/bin/specedge doctor --bundle /work/bundles/smollm2-feature-int4 --threads 2 \
    | tee "$REPORT/doctor.txt"

step "decodes on aarch64 against x86's"
in_arm64 /venv/bin/python /work/tests/arm64/reference_decodes.py check /work/bundles \
    /work/reference.json | tee "$REPORT/decodes.txt"
cp "$WORK/reference.json" "$WORK/reference.check.json" "$REPORT/"

step "runtime and server tests on aarch64"
# The root filesystem has no shell: pytest gets the files' paths under /work.
tests=()
for word in $ARM64_TESTS; do
    case $word in *::*) tests+=("$word") ;; tests/*) tests+=("/work/$word") ;; *) tests+=("$word") ;; esac
done
in_arm64 /venv/bin/python -m pytest -q -p no:cacheprovider --rootdir /work --durations=10 \
    "${tests[@]}" | tee "$REPORT/tests.txt"

step "done: reports in $REPORT"
