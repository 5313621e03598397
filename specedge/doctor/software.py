"""What will run on this device: the versions of what specedge runs on, and, for each
backend, whether it can run here, and if not why and the command that fixes it.

Each backend is asked the way the runtime asks when it loads one (the same imports and
checks, raising the same BackendUnavailableError with the same fix), without a bundle.
"""

from __future__ import annotations

import importlib
import platform
from dataclasses import dataclass
from importlib import metadata

from specedge.runtime.backends import BACKENDS
from specedge.runtime.backends.engine_manifest import tensorrt_major
from specedge.runtime.backends.engines import import_tensorrt
from specedge.runtime.backends.gpu_info import (
    cuda_version,
    cuda_versions,
    cudart_module,
    gpu_identity,
)
from specedge.runtime.backends.ort_cpu import MIN_ORT_BATCHED, MIN_ORT_FUSED
from specedge.runtime.backends.sampling_kernels import import_cuda
from specedge.runtime.errors import BackendUnavailableError

# Distributions whose versions the report gives, where installed. NVRTC's wheel is named
# per CUDA major version.
PACKAGES = ("numpy", "onnxruntime", "onnxruntime-gpu", "tokenizers", "cuda-bindings",
            "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "tensorrt", "specedge")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    runs: bool
    why: str          # what it runs on, or why it cannot run here and what fixes it


def versions() -> dict[str, str | None]:
    """Python's and each installed distribution's version (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def onnxruntime_providers() -> list[str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


def cuda_facts() -> dict[str, str | None]:
    """The CUDA version the driver supports, cuda-python's runtime, NVRTC's version and the
    GPU, each None where it cannot be had (with `why` saying what stopped the first one)."""
    facts: dict[str, str | None] = {"driver_cuda": None, "runtime_cuda": None, "nvrtc": None,
                                    "gpu": None, "why": None}
    try:
        cudart = cudart_module()
    except BackendUnavailableError as e:
        facts["why"] = str(e)
        return facts
    driver, runtime = cuda_versions(cudart)
    facts["driver_cuda"] = cuda_version(driver) if driver else None
    facts["runtime_cuda"] = cuda_version(runtime) if runtime else None
    try:
        _, major, minor = import_cuda("nvrtc").nvrtcVersion()
        facts["nvrtc"] = f"{major}.{minor}"
    except BackendUnavailableError as e:
        facts["why"] = str(e)
    try:
        name, (major, minor) = gpu_identity()
        facts["gpu"] = f"{name} (compute capability {major}.{minor})"
    except BackendUnavailableError as e:
        facts["why"] = str(e)
    return facts


def _onnxruntime_status() -> tuple[bool, str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return False, "onnxruntime is not installed: pip install onnxruntime"
    here = tuple(int(p) for p in ort.__version__.split(".")[:2])
    notes = [f"onnxruntime {ort.__version__}"]
    for what, need in (("fused (GroupQueryAttention) bundles", MIN_ORT_FUSED),
                       ("batched-attention bundles", MIN_ORT_BATCHED)):
        if here < need:
            notes.append(f"{what} need onnxruntime >= {'.'.join(map(str, need))}: "
                         "pip install -U onnxruntime")
    return True, "; ".join(notes)


def backend_status(name: str) -> BackendStatus:
    """Whether backend `name` can run here, and what it runs on or why not."""
    ok, why = _onnxruntime_status()
    if name == "ort-cpu":
        return BackendStatus(name, ok, f"ONNX Runtime's CPU provider ({why})" if ok else why)
    if name == "host-emulated":
        return BackendStatus(name, ok, "the GPU backends' code on the CPU, for tests; slower "
                             "than ort-cpu" if ok else why)
    try:
        if name == "tensorrt":
            tensorrt_major(import_tensorrt().__version__)
        elif not ok:
            return BackendStatus(name, False, why)
        elif "CUDAExecutionProvider" not in onnxruntime_providers():
            return BackendStatus(name, False, "needs onnxruntime-gpu: pip uninstall "
                                 "onnxruntime && pip install onnxruntime-gpu")
        gpu, (major, minor) = gpu_identity()
    except BackendUnavailableError as e:
        return BackendStatus(name, False, str(e))
    what = "TensorRT engines" if name == "tensorrt" else "ONNX Runtime's CUDA provider"
    return BackendStatus(name, True, f"{what} on {gpu} (compute capability {major}.{minor})")


def backend_statuses() -> list[BackendStatus]:
    return [backend_status(name) for name in BACKENDS]


def tensorrt_version() -> str | None:
    """TensorRT's version where the module imports (JetPack installs it outside pip)."""
    try:
        return importlib.import_module("tensorrt").__version__
    except ImportError:
        return None
