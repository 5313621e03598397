"""What this device is: CPU, memory, operating system and, on a Jetson, the board and its
JetPack release, read from the files Linux keeps for them (/proc/cpuinfo, /proc/meminfo,
/etc/os-release, /proc/device-tree/model, /etc/nv_tegra_release).

The parsers are pure functions of those files' text, so every board they describe is tested
with the text it writes; `read_machine` reads this one's.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# The instruction sets that decide which kernels ONNX Runtime's CPU provider runs for
# specedge's graphs, by the names /proc/cpuinfo gives them: float math (AVX2/FMA, AVX-512,
# NEON), and the int8 dot products that its int8 and int4 matrix products use (VNNI on x86,
# dotprod and i8mm on ARM) ...
X86_ISA = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
           "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
ARM_ISA = ("asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")
# ... and, of those, the int8 dot products.
INT8_DOT = {"avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI", "amx_int8": "AMX-INT8",
            "asimddp": "dotprod", "i8mm": "i8mm"}

# ARM's own cores by the "CPU part" of /proc/cpuinfo (implementer 0x41), for the boards
# people deploy to: Raspberry Pi 4 and 5, Jetson Nano and Orin, Graviton and Ampere servers.
ARM_PARTS = {0xD03: "Cortex-A53", 0xD04: "Cortex-A35", 0xD05: "Cortex-A55",
             0xD07: "Cortex-A57", 0xD08: "Cortex-A72", 0xD09: "Cortex-A73",
             0xD0A: "Cortex-A75", 0xD0B: "Cortex-A76", 0xD0C: "Neoverse N1",
             0xD0D: "Cortex-A77", 0xD40: "Neoverse V1", 0xD41: "Cortex-A78",
             0xD42: "Cortex-A78AE", 0xD44: "Cortex-X1", 0xD46: "Cortex-A510",
             0xD47: "Cortex-A710", 0xD49: "Neoverse N2", 0xD4F: "Neoverse V2"}

# The same instruction sets on aarch64 as the kernel's hardware-capability bits (getauxval
# AT_HWCAP and AT_HWCAP2; the kernel's arch/arm64 uapi hwcap.h), which a process reads
# even where /proc is not mounted (a container, a chroot under emulation).
ARM_HWCAP = {"asimd": (1, 1 << 1), "asimdhp": (1, 1 << 10), "asimddp": (1, 1 << 20),
             "sve": (1, 1 << 22), "i8mm": (2, 1 << 13), "bf16": (2, 1 << 14),
             "sve2": (2, 1 << 1)}
AT_HWCAP, AT_HWCAP2 = 16, 26

# L4T release (/etc/nv_tegra_release) -> JetPack release, from NVIDIA's JetPack archive.
JETPACK = {"36.4.4": "6.2.1", "36.4.3": "6.2", "36.4.0": "6.1", "36.3.0": "6.0",
           "35.6.0": "5.1.4", "35.5.0": "5.1.3", "35.4.1": "5.1.2", "35.3.1": "5.1.1"}


@dataclass(frozen=True)
class Cpu:
    arch: str              # platform.machine(): x86_64, aarch64
    model: str
    logical_cores: int
    usable_cores: int      # the cores this process may run on (its affinity)
    physical_cores: int    # one thread of ONNX Runtime per physical core is the fastest
    isa: tuple[str, ...]   # of X86_ISA / ARM_ISA, as /proc/cpuinfo names them

    @property
    def int8_dot(self) -> tuple[str, ...]:
        """The int8 dot-product instructions ONNX Runtime's int8 and int4 kernels can use."""
        return tuple(INT8_DOT[f] for f in self.isa if f in INT8_DOT)


@dataclass(frozen=True)
class Jetson:
    board: str              # /proc/device-tree/model
    l4t: str | None         # e.g. "36.4.3"
    jetpack: str | None     # e.g. "6.2", None for an L4T release not in JETPACK


@dataclass(frozen=True)
class Machine:
    cpu: Cpu
    memory_total_mb: int | None
    memory_available_mb: int | None
    os: str
    kernel: str
    board: str | None       # the device tree's model: a Raspberry Pi, a Jetson, ...
    jetson: Jetson | None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cpu"]["int8_dot"] = list(self.cpu.int8_dot)
        return d


def _fields(block: str) -> dict[str, str]:
    out = {}
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def cpu_from_cpuinfo(text: str, arch: str, usable_cores: int | None = None) -> Cpu:
    """The CPU that /proc/cpuinfo's `text` describes, on architecture `arch`."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if "processor" in b.lower()]
    procs = [_fields(b) for b in blocks]
    whole = _fields(text)  # the lines outside the per-processor blocks (a Pi's "Model")
    first = procs[0] if procs else whole
    logical = max(len(procs), 1)
    if arch in ("x86_64", "amd64", "i686"):
        flags = set(first.get("flags", "").split())
        isa = tuple(f for f in X86_ISA if f in flags)
        model = first.get("model name", "unknown x86 CPU")
        cores = {(p.get("physical id"), p.get("core id")) for p in procs
                 if p.get("core id") is not None}
        physical = len(cores) or logical
    else:
        flags = set(first.get("features", "").split())
        isa = tuple(f for f in ARM_ISA if f in flags)
        model = whole.get("model") or _arm_model(procs)
        physical = logical  # ARM cores run one thread each
    return Cpu(arch, model, logical, usable_cores or logical, physical, isa)


def _arm_model(procs: list[dict[str, str]]) -> str:
    """'4x Cortex-A76' or '6x Cortex-A78AE', from each processor's implementer and part."""
    names: dict[str, int] = {}
    for p in procs:
        try:
            implementer, part = int(p["cpu implementer"], 16), int(p["cpu part"], 16)
        except (KeyError, ValueError):
            continue
        name = (ARM_PARTS.get(part, f"ARM part {part:#x}") if implementer == 0x41
                else f"implementer {implementer:#x} part {part:#x}")
        names[name] = names.get(name, 0) + 1
    return " + ".join(f"{n}x {name}" for name, n in names.items()) or "unknown ARM CPU"


def arm_isa_from_hwcap(hwcap: int, hwcap2: int) -> tuple[str, ...]:
    """ARM_ISA's names of the bits set in AT_HWCAP and AT_HWCAP2."""
    words = {1: hwcap, 2: hwcap2}
    return tuple(f for f in ARM_ISA if words[ARM_HWCAP[f][0]] & ARM_HWCAP[f][1])


def _hwcaps() -> tuple[int, int] | None:
    """This process's AT_HWCAP and AT_HWCAP2 (glibc's getauxval), None where unreadable."""
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype = ctypes.c_ulong
        getauxval.argtypes = [ctypes.c_ulong]
        return int(getauxval(AT_HWCAP)), int(getauxval(AT_HWCAP2))
    except (OSError, AttributeError):
        return None


def memory_from_meminfo(text: str) -> tuple[int | None, int | None]:
    """(total, available) megabytes from /proc/meminfo's `text`."""
    values = {}
    for key in ("MemTotal", "MemAvailable"):
        m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
        values[key] = int(m.group(1)) // 1024 if m else None
    return values["MemTotal"], values["MemAvailable"]


def jetson_from(board: str | None, tegra_release: str | None) -> Jetson | None:
    """A Jetson's board and releases from its device-tree model and /etc/nv_tegra_release
    ("# R36 (release), REVISION: 4.3, ..."); None on any other device."""
    if tegra_release is None and not (board and "jetson" in board.lower()):
        return None
    l4t = None
    m = re.search(r"R(\d+) \(release\), REVISION: (\d+)\.(\d+)", tegra_release or "")
    if m:
        l4t = f"{m.group(1)}.{m.group(2)}.{m.group(3)}"
    return Jetson(board or "unknown Jetson", l4t, JETPACK.get(l4t) if l4t else None)


def os_name(os_release: str | None) -> str:
    """PRETTY_NAME of /etc/os-release's text, else Python's platform name."""
    m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', os_release or "", re.M)
    return m.group(1) if m else platform.platform()


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace").replace("\0", "").strip()
    except OSError:
        return None


def read_machine() -> Machine:
    """This device's Machine."""
    arch = platform.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    cpuinfo = _read("/proc/cpuinfo")
    if cpuinfo is not None:
        cpu = cpu_from_cpuinfo(cpuinfo, arch, usable)
    else:
        logical = os.cpu_count() or 1
        cpu = Cpu(arch, platform.processor() or f"unknown {arch} CPU", logical, usable,
                  logical, ())
    hwcaps = _hwcaps() if arch in ("aarch64", "arm64") else None
    if hwcaps and not cpu.isa:  # no /proc: the kernel's bits say the same
        cpu = replace(cpu, isa=arm_isa_from_hwcap(*hwcaps))
    total, available = memory_from_meminfo(_read("/proc/meminfo") or "")
    if total is None:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
        except (ValueError, OSError):
            pass
    board = _read("/proc/device-tree/model")
    return Machine(cpu, total, available, os_name(_read("/etc/os-release")),
                   platform.release(), board, jetson_from(board, _read("/etc/nv_tegra_release")))
