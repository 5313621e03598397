"""Backends run one graph of a bundle: `forward(cache, token_ids, logits_to_keep)`.

Every backend implements the same call: feed T tokens at positions [cache.length,
cache.length + T), read the cache rows [0, cache.length), write the T new K/V rows into the
cache, return logits for the last `logits_to_keep` positions. Backends are chosen by name.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np

from specedge.runtime import cpu_load
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import KV_LAYOUT_IN_PLACE, Bundle, ModelSpec
from specedge.runtime.config import check_spinning, check_threads
from specedge.runtime.errors import BackendUnavailableError

BACKENDS = ("ort-cpu", "ort-cuda", "tensorrt", "host-emulated")
# The backends whose models run on ONNX Runtime's CPU thread pools, which `threads` and
# `spinning` set.
CPU_THREAD_BACKENDS = ("ort-cpu", "host-emulated")


class Cache(Protocol):
    """A model's KV cache as the loop sees it: rows [0, length) are valid, `capacity` rows
    exist. Rollback is setting the length back (docs/design.md#kv-cache)."""

    length: int
    capacity: int

    def rollback(self, length: int) -> None: ...

    def grown(self, capacity: int) -> Cache:
        """A copy with more rows, asked for between steps only of a backend whose
        `grows_cache` is true (a host cache); other caches are sized once per
        generation."""


class Backend(Protocol):
    """What the loop and the drafters use of a backend."""

    name: str
    spec: ModelSpec
    run_seconds: float  # inside model execution, for the share of time outside models
    grows_cache: bool   # its caches may be swapped for `grown` ones between steps
    # The last call's hidden features [T, H], read by a feature draft (bundles with feature
    # I/O, which run on ort-cpu only).
    features: np.ndarray | None

    def new_cache(self, capacity: int) -> Cache: ...

    def forward(self, cache: Cache, token_ids: list[int] | np.ndarray,
                logits_to_keep: int = 1) -> np.ndarray: ...


def load_backend(name: str, bundle: Bundle, role: str, threads: int | None = None,
                 spinning: bool | str = False) -> Backend:
    """The backend called `name` for the bundle's `role` graph ("target" or "draft"), with
    `threads` ONNX Runtime CPU threads that spin while they wait for work when `spinning`
    (ort-cpu and host-emulated; a GPU backend's session runs on its device).

    Devices are opened when asked for, so a missing GPU, driver or package is a
    BackendUnavailableError that names what to install, or 'ort-cpu' as what works.
    "host-emulated" is the device backend's own code on host memory and ONNX Runtime CPU:
    what CI runs in place of a GPU.
    """
    check_threads(threads)
    if check_spinning(spinning) == "auto":  # decided once here; a Generator follows the load
        spinning = name in CPU_THREAD_BACKENDS and cpu_load.first_choice(cpu_load.LoadMeter())
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    try:
        import onnxruntime as ort
    except ImportError as e:
        if name != "tensorrt":
            raise BackendUnavailableError(f"backend {name!r} needs onnxruntime: "
                                          "pip install onnxruntime") from e
    spec = getattr(bundle, role)
    if name == "ort-cpu":
        # Only the target's rows must agree with verification calls (ort_cpu.py); a draft's
        # one-token steps need not, so they run as one row.
        return OrtCpuBackend(spec, threads, one_token_as_two=None if role == "target"
                             else False, spinning=spinning)
    if spec.kv_layout == KV_LAYOUT_IN_PLACE:
        raise BackendUnavailableError(
            f"this bundle's {role} graph uses ONNX Runtime's CPU attention (KV layout "
            f"{KV_LAYOUT_IN_PLACE!r}), which runs on backend 'ort-cpu' only; for {name!r}, "
            "export the bundle with --attention portable")
    if spec.features:
        raise BackendUnavailableError(
            f"this bundle has a feature draft, which runs on backend 'ort-cpu' only for now; "
            f"for {name!r}, export the bundle with a model draft (--draft-layers N or a "
            "model draft folder)")
    from specedge.runtime.backends.device import DeviceBackend
    from specedge.runtime.backends.device_sampling import HostSampler
    from specedge.runtime.backends.engines import OrtEngine, TrtEngine, import_tensorrt
    from specedge.runtime.backends.memory import CudaMemory, HostMemory

    if name == "host-emulated":
        memory = HostMemory()
        return DeviceBackend(name, spec, OrtEngine(spec, "cpu", threads, spinning), memory,
                             HostSampler(memory))
    if name == "ort-cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise BackendUnavailableError(
            "backend 'ort-cuda' needs onnxruntime-gpu (pip uninstall onnxruntime && pip "
            "install onnxruntime-gpu) and a CUDA GPU; backend 'ort-cpu' works without them")
    if name == "tensorrt":
        import_tensorrt()  # the missing package first: it is what the user must install
    memory = CudaMemory()
    engine = OrtEngine(spec, "cuda") if name == "ort-cuda" else TrtEngine(bundle, role, memory)
    return DeviceBackend(name, spec, engine, memory, _device_sampler(memory))


def _device_sampler(memory):
    """NVRTC sampling kernels on `memory`'s device, or None (sampling on the host) when they
    cannot be had: NVRTC missing, a compile error, or a kernel image the driver refuses
    (DeviceSampler raises BackendUnavailableError for each). The model still runs on the
    GPU either way; the host path only copies the logits back, and the warning says why."""
    from specedge.runtime.backends.device_sampling import DeviceSampler

    try:
        return DeviceSampler(memory)
    except BackendUnavailableError as e:
        warnings.warn(f"sampling on the host: {e}", stacklevel=3)
        return None
