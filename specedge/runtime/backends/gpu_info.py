"""Which GPU this is: name and compute capability, through cuda-python (no torch, no TensorRT).

A TensorRT engine only runs on the GPU model and TensorRT version it was built with, so both
`specedge build` (to record them) and the runtime (to compare) ask this.
"""

from __future__ import annotations

from specedge.runtime.errors import BackendUnavailableError


def cudart_module():
    """cuda-python's runtime API module, or BackendUnavailableError naming the package."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python layout
        except ImportError:
            raise BackendUnavailableError(
                "cuda-python is not installed: pip install cuda-python (the TensorRT backend "
                "uses it to find the GPU); the ort-cpu backend works without it") from None
    return cudart


def _check(cudart, result: tuple, call: str):
    """cuda-python returns (error, value...); turn an error into a message the user can act on."""
    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        raise BackendUnavailableError(
            f"no usable CUDA GPU: {call} failed with {name}: check that the NVIDIA driver is "
            "installed and sees the GPU (nvidia-smi, or tegrastats on Jetson); the ort-cpu "
            "backend works without a GPU")
    return values[0] if len(values) == 1 else values


def gpu_identity(device: int = 0) -> tuple[str, tuple[int, int]]:
    """(name, (major, minor)) of CUDA device `device`, e.g. ("NVIDIA H100", (9, 0)).

    Raises BackendUnavailableError when cuda-python, the driver or the GPU is missing.
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
