"""scripts/install_llama_cpp.sh --dry-run: the CMake options it builds llama.cpp with, from
the CPU flags it reads (a stand-in /proc/cpuinfo), without building anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "install_llama_cpp.sh"
AVX512 = "avx512f avx512cd avx512vl avx512dq avx512bw"


def options(tmp_path: Path, flags: str) -> dict[str, str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\nbugs\t\t: avx512_bf16\n")
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                          env={"CPUINFO": str(cpuinfo), "PATH": "/usr/bin:/bin"}, check=True)
    (line,) = done.stdout.splitlines()
    assert line.startswith("CMAKE_ARGS=")
    return dict(arg.removeprefix("-D").split("=") for arg in line.split("=", 1)[1].split())


@pytest.mark.parametrize(("flags", "on"), [
    ("avx avx2 fma f16c bmi2", {"AVX", "AVX2", "FMA", "F16C", "BMI2"}),
    (f"avx avx2 fma f16c bmi2 {AVX512} avx512vbmi avx512_vnni avx512_bf16 avx_vnni",
     {"AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
      "AVX512_BF16", "AVX_VNNI"}),
    # AVX512 needs the five subsets its compiler flags name; its extensions need it
    ("avx avx2 avx512f avx512vbmi avx512_vnni", {"AVX", "AVX2"}),
    (f"avx avx2 {AVX512} avx512_vnni", {"AVX", "AVX2", "AVX512", "AVX512_VNNI"}),
    ("avx avx2 avx_vnni", {"AVX", "AVX2", "AVX_VNNI"}),
    ("", set()),
])
def test_each_instruction_set_the_cpu_reports_is_switched_on(tmp_path, flags, on):
    got = options(tmp_path, flags)
    assert got.pop("GGML_NATIVE") == "OFF"  # never native: see the script's header
    assert set(got) == {"GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2",
                        "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
                        "GGML_AVX512_BF16", "GGML_AVX_VNNI"}
    assert {name.removeprefix("GGML_") for name, v in got.items() if v == "ON"} == on
    assert all(v in ("ON", "OFF") for v in got.values())
