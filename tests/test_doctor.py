"""`specedge doctor`: the device read from the text Linux writes for it (an x86 server, a
Raspberry Pi 5, a Jetson Orin), which backends run and why not, the advice, and the
command on this machine, with and without a bundle."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
import types
from argparse import Namespace

from cuda_stand_in import fake_cudart

from specedge.doctor import cli as doctor_cli
from specedge.doctor import software
from specedge.doctor.bundle_check import BundleRun, advise
from specedge.doctor.machine import (
    Cpu,
    Machine,
    arm_isa_from_hwcap,
    cpu_from_cpuinfo,
    jetson_from,
    memory_from_meminfo,
    os_name,
)
from specedge.doctor.software import BackendStatus
from specedge.runtime.bundle import load_bundle

X86 = "\n\n".join(f"""processor\t: {i}
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
physical id\t: 0
core id\t\t: {i // 2}
flags\t\t: fpu sse4_2 avx f16c fma avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16
""" for i in range(4))

PI5_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                "lrcpc dcpop asimddp")
PI5 = "\n\n".join(f"""processor\t: {i}
BogoMIPS\t: 108.00
Features\t: {PI5_FEATURES}
CPU implementer\t: 0x41
CPU part\t: 0xd0b
""" for i in range(4)) + """

Revision\t: d04170
Serial\t\t: 6f4a1b2c3d4e5f60
Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""

ORIN = "\n\n".join(f"""processor\t: {i}
Features\t: {PI5_FEATURES} uscat ilrcpc flagm
CPU implementer\t: 0x41
CPU part\t: 0xd42
""" for i in range(6))
TEGRA = ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
         "DATE: Wed Jan  8 01:49:37 UTC 2025")


def test_an_x86_server_with_vnni():
    cpu = cpu_from_cpuinfo(X86, "x86_64", usable_cores=3)
    assert cpu.model == "AMD EPYC 9R14 96-Core Processor"
    assert (cpu.logical_cores, cpu.physical_cores, cpu.usable_cores) == (4, 2, 3)
    assert cpu.isa == ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                       "avx512_vnni", "avx512_bf16")
    assert cpu.int8_dot == ("AVX512-VNNI",)


def test_a_raspberry_pi_5():
    cpu = cpu_from_cpuinfo(PI5, "aarch64")
    assert cpu.model == "Raspberry Pi 5 Model B Rev 1.0"
    assert (cpu.logical_cores, cpu.physical_cores) == (4, 4)
    assert cpu.isa == ("asimd", "asimdhp", "asimddp") and cpu.int8_dot == ("dotprod",)
    assert jetson_from("Raspberry Pi 5 Model B Rev 1.0", None) is None


def test_a_jetson_orin_and_its_jetpack():
    cpu = cpu_from_cpuinfo(ORIN, "aarch64")
    assert cpu.model == "6x Cortex-A78AE" and cpu.int8_dot == ("dotprod",)
    jetson = jetson_from("NVIDIA Jetson Orin Nano Developer Kit", TEGRA)
    assert (jetson.board, jetson.l4t, jetson.jetpack) == (
        "NVIDIA Jetson Orin Nano Developer Kit", "36.4.3", "6.2")
    unknown = jetson_from("NVIDIA Jetson AGX Orin", TEGRA.replace("4.3", "9.0"))
    assert unknown.l4t == "36.9.0" and unknown.jetpack is None


def test_arm_instruction_sets_from_the_kernels_bits():
    """Where /proc is not mounted (a chroot, a container) the hardware-capability bits give
    the same names: a Cortex-A76's (NEON, fp16, dotprod) and a Neoverse V1's (with i8mm,
    bf16 and SVE)."""
    assert arm_isa_from_hwcap((1 << 1) | (1 << 10) | (1 << 20), 0) == (
        "asimd", "asimdhp", "asimddp")
    assert arm_isa_from_hwcap((1 << 1) | (1 << 20) | (1 << 22), (1 << 13) | (1 << 14)) == (
        "asimd", "asimddp", "i8mm", "bf16", "sve")
    assert arm_isa_from_hwcap(0, 0) == ()


def test_memory_and_os():
    assert memory_from_meminfo("MemTotal:        8045676 kB\nMemFree:  1 kB\n"
                               "MemAvailable:    6291456 kB\n") == (7857, 6144)
    assert memory_from_meminfo("") == (None, None)
    assert os_name('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.5 LTS"\n') == "Ubuntu 22.04.5 LTS"


def test_backends_without_a_gpu_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # not installed
    fake_cudart(monkeypatch, "cudaErrorNoDevice", 0)
    status = {s.name: s for s in software.backend_statuses()}
    assert status["ort-cpu"].runs and status["host-emulated"].runs
    assert not status["tensorrt"].runs and "pip install tensorrt" in status["tensorrt"].why
    assert not status["ort-cuda"].runs


def test_backends_with_a_gpu(monkeypatch):
    fake_cudart(monkeypatch)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    monkeypatch.setattr(software, "onnxruntime_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    status = {s.name: s for s in software.backend_statuses()}
    assert status["tensorrt"].runs and "NVIDIA Jetson AGX Orin" in status["tensorrt"].why
    assert status["ort-cuda"].runs and "8.7" in status["ort-cuda"].why
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="9.2.0"))
    assert "TensorRT 9.2.0 is not supported" in software.backend_status("tensorrt").why


MACHINE = Machine(Cpu("aarch64", "6x Cortex-A78AE", 6, 4, 6, ("asimd", "asimddp")),
                  7857, 6144, "Ubuntu 22.04.5 LTS", "5.15.148-tegra", None, None)


def test_advice_takes_the_fastest_backend_that_loaded(tiny_batched_bundle):
    statuses = [BackendStatus("ort-cpu", True, ""), BackendStatus("tensorrt", True, ""),
                BackendStatus("host-emulated", True, "")]
    runs = [BundleRun("ort-cpu", True, None, 1.0, 30.0), BundleRun("tensorrt", True, None,
                                                                   2.0, 4.0),
            BundleRun("host-emulated", True, None, 1.0, 2.0)]  # never advised
    advice = advise(MACHINE, statuses, runs, None)
    assert (advice.backend, advice.threads, advice.precision) == ("tensorrt", 4, "fp16")
    advice = advise(MACHINE, statuses, runs[:1] + [BundleRun("tensorrt", False, "no engines")],
                    None)
    assert (advice.backend, advice.precision) == ("ort-cpu", "int4")
    assert any("dotprod" in reason for reason in advice.why)
    assert any("on aarch64 greedy speculative output can part" in reason
               for reason in advice.why)
    batched = advise(MACHINE, statuses, runs[:1], load_bundle(tiny_batched_bundle))
    assert not any("aarch64" in reason for reason in batched.why)
    x86 = dataclasses.replace(MACHINE, cpu=Cpu("x86_64", "AMD EPYC", 2, 2, 2, ("avx512_vnni",)))
    advice = advise(x86, statuses, runs[:1], None)
    assert advice.precision == "int4"
    assert not any("aarch64" in reason for reason in advice.why)
    no_bundle = advise(MACHINE, statuses, None, None)
    assert no_bundle.backend == "tensorrt"


def test_advice_names_a_bundle_of_another_precision(tiny_bundle):
    advice = advise(MACHINE, [BackendStatus("ort-cpu", True, "")], None,
                    load_bundle(tiny_bundle))
    assert advice.backend == "ort-cpu"
    assert any("this bundle is fp32: re-export it with --precision int4" in reason
               for reason in advice.why), advice.why


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specedge.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=300)


def test_doctor_on_this_machine_with_a_bundle(tiny_bundle):
    done = _doctor("--json", "--bundle", str(tiny_bundle), "--threads", "1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["machine"]["cpu"]["arch"] == platform.machine()
    assert report["machine"]["cpu"]["logical_cores"] >= 1
    assert report["versions"]["onnxruntime"] and report["versions"]["python"]
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["ort-cpu"]["runs"]
    runs = {r["backend"]: r for r in report["bundle"]["backends"]}
    assert runs["ort-cpu"]["loads"] and runs["ort-cpu"]["load_seconds"] > 0
    assert runs["ort-cpu"]["step_ms"] > 0
    assert report["advice"]["backend"] in ("ort-cpu", "ort-cuda", "tensorrt")
    screen = _doctor()
    assert screen.returncode == 0, screen.stderr
    assert "Backends" in screen.stdout and "Recommended: --backend" in screen.stdout


def test_doctor_errors(tmp_path, monkeypatch, tiny_bundle, capsys):
    """A bundle that cannot be read: the device's report still, then the bundle's problem
    (in the report and as one line on stderr), exit status 2."""
    done = _doctor("--bundle", str(tmp_path / "missing"))
    assert done.returncode == 2 and "missing does not exist" in done.stderr
    assert "Backends" in done.stdout and "CPU" in done.stdout
    assert "cannot be read: the bundle folder" in done.stdout
    (tmp_path / "manifest.json").write_text("{")
    done = _doctor("--bundle", str(tmp_path))
    assert done.returncode == 2 and "re-export the bundle" in done.stderr
    assert "Backends" in done.stdout and "Traceback" not in done.stderr
    done = _doctor("--json", "--bundle", str(tmp_path))
    report = json.loads(done.stdout)
    assert done.returncode == 2 and "re-export the bundle" in report["bundle"]["error"]
    assert report["backends"] and report["bundle"]["backends"] == []
    # A bundle that loads on no backend here: exit status 1, each backend's reason shown.
    monkeypatch.setattr(software, "backend_statuses",
                        lambda: [BackendStatus("ort-cpu", False, "onnxruntime is broken")])
    args = Namespace(bundle=tiny_bundle, threads=1, json=False)
    assert doctor_cli.run(args) == 1
    assert "does not load: onnxruntime is broken" in capsys.readouterr().out


def test_doctor_help():
    done = _doctor("--help")
    assert done.returncode == 0 and "--bundle" in done.stdout


def test_advice_says_when_the_bundle_has_the_advised_precision(tiny_fused_int4_bundle):
    advice = advise(MACHINE, [BackendStatus("ort-cpu", True, "")], None,
                    load_bundle(tiny_fused_int4_bundle))
    assert advice.precision == "int4"
    assert "this bundle is int4 already" in advice.why, advice.why
    assert not any("re-export it with --precision" in reason for reason in advice.why)
