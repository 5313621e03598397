"""Which GPU this is: name and compute capability, through cuda-python (no torch, no TensorRT).

A TensorRT engine only runs on the GPU model and TensorRT version it was built with, so both
`specedge build` (to record them) and the runtime (to compare) ask this.

cuda-python comes in two lines, one per CUDA major version, and a driver serves only the
line of its own major version or an older one: cuda-bindings 13 links the CUDA 13 runtime and
needs a CUDA 13 driver (r580 or newer); cuda-bindings 12 serves CUDA 12.x drivers, such as
JetPack 6's (CUDA 12.6). Both lines have the modules `cuda.bindings.runtime`, `.driver` and
`.nvrtc` (since cuda-python 12.6.1), with the same names and signatures for every call
specedge makes, so one code path serves both; the extra that installs each line is named
in the messages below.
"""

from __future__ import annotations

import importlib

from specedge.runtime.errors import BackendUnavailableError

# CUDA major version -> the specedge extra that installs cuda-python and NVRTC for it.
EXTRAS = {12: "cuda12", 13: "cuda13"}
# CUDA major version -> the oldest Linux driver branch that runs it.
DRIVERS = {12: "r525", 13: "r580"}
INSTALL_HINT = ("pip install 'specedge[cuda13]' for a CUDA 13 driver (r580 or newer), or "
                "'specedge[cuda12]' for a CUDA 12.x driver (JetPack 6); cuda-python alone: "
                "pip install cuda-python (13.x) or 'cuda-python>=12.8,<13'")


def cuda_version(encoded: int) -> str:
    """CUDA's version encoding as text: 12060 -> "12.6"."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def install_hint() -> str:
    """What to install for the GPU path: the extra of the cuda-python line already installed
    (its NVRTC wheel may be what is missing), else both extras with the drivers they need."""
    try:
        major = int(importlib.import_module("cuda.bindings").__version__.split(".")[0])
    except (ImportError, AttributeError, ValueError):
        return INSTALL_HINT
    return f"pip install 'specedge[{EXTRAS[major]}]'" if major in EXTRAS else INSTALL_HINT


def cudart_module():
    """cuda-python's runtime API module, or BackendUnavailableError naming the package."""
    try:
        # importlib rather than `from cuda.bindings import runtime`, so that a test can hide
        # or replace it through sys.modules.
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        raise BackendUnavailableError(
            f"cuda-python is not installed (the GPU backends use it): {INSTALL_HINT}; the "
            "ort-cpu backend works without it") from None


def driver_too_old(driver: int, runtime: int) -> str | None:
    """Why a driver that supports CUDA `driver` cannot serve the CUDA `runtime` built into the
    installed cuda-python (both in CUDA's encoding, 12060 = 12.6), and what to do; None when
    it can, or when either is unknown (0)."""
    if not driver or not runtime or driver >= runtime:
        return None
    have, ours = cuda_version(driver), runtime // 1000
    if driver // 1000 == ours:
        # Same major version: minor-version compatibility should cover it, so this driver
        # lacks something the newer runtime asks for.
        return (f"this driver supports CUDA {have}, older than the CUDA {cuda_version(runtime)} "
                "runtime of the installed cuda-python: update the driver, or install a "
                f"cuda-python no newer than the driver (pip install 'cuda-python=={have}.*')")
    extra = EXTRAS.get(driver // 1000)
    fix = (f"pip install 'specedge[{extra}]' (cuda-python and NVRTC for CUDA {driver // 1000}), "
           "or update the driver" if extra else "update the driver")
    return (f"this driver supports CUDA {have}, but the installed cuda-python is built for "
            f"CUDA {ours} (driver {DRIVERS.get(ours, f'of CUDA {ours}')} or newer): {fix}")


def cuda_versions(cudart) -> tuple[int, int]:
    """(driver's CUDA version, cuda-python's runtime version); 0 for one that is unknown.

    cudaDriverGetVersion answers even when the runtime cannot start (0 when no driver is
    installed); cudaRuntimeGetVersion is the runtime built into cuda-python.
    """
    versions = []
    for call in ("cudaDriverGetVersion", "cudaRuntimeGetVersion"):
        try:
            err, version = getattr(cudart, call)()
        except (AttributeError, RuntimeError):  # an old or stand-in module; no library
            err, version = None, 0
        versions.append(int(version) if err == cudart.cudaError_t.cudaSuccess else 0)
    return versions[0], versions[1]


def _check(cudart, result: tuple, call: str):
    """cuda-python returns (error, value...); turn an error into a message the user can act on."""
    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        too_old = driver_too_old(*cuda_versions(cudart))
        if too_old:
            raise BackendUnavailableError(
                f"{call} failed with {name}: check that the NVIDIA driver is new enough: "
                f"{too_old}")
        raise BackendUnavailableError(
            f"no usable CUDA GPU: {call} failed with {name}: check that the NVIDIA driver is "
            "installed and sees the GPU (nvidia-smi, or tegrastats on Jetson); the ort-cpu "
            "backend works without a GPU")
    return values[0] if len(values) == 1 else values


def gpu_identity(device: int = 0) -> tuple[str, tuple[int, int]]:
    """(name, (major, minor)) of CUDA device `device`, e.g. ("NVIDIA H100", (9, 0)).

    Raises BackendUnavailableError when cuda-python, the driver or the GPU is missing, or
    when the driver is too old for the installed cuda-python (the message names the extra
    that fits the driver).
    """
    cudart = cudart_module()
    count = _check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
    if not count:
        raise BackendUnavailableError("no CUDA GPU found (the driver reports 0 devices); the "
                                      "ort-cpu backend works without a GPU")
    if not 0 <= device < count:
        raise ValueError(f"GPU {device} does not exist: this machine has {count} "
                         f"(0..{count - 1})")
    prop = _check(cudart, cudart.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = prop.name
    if isinstance(name, (bytes, bytearray)):  # a fixed char[256], NUL padded
        name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    return str(name).strip(), (int(prop.major), int(prop.minor))
