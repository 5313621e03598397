"""Device memory behind one narrow interface, so the device backend's orchestration is plain
Python that CI runs on host arrays.

    alloc(nbytes) -> address      free(address)            synchronize()
    upload(address, array)        download(address, out)   copy_2d(dst, dst_pitch, src,
                                                                   src_pitch, width, height)

`CudaMemory` serves it with cuda-python (cudaMalloc, cudaMemcpyAsync, cudaMemcpy2DAsync on
one stream); `HostMemory` with numpy buffers at real host addresses, which ONNX Runtime's
CPU provider can bind, so CI runs the same code path as `ort-cuda` with the device
replaced. `copy_2d` is cudaMemcpy2D's contract: `height` rows of `width` bytes, rows
`pitch` bytes apart; it is how T new K/V rows of every head land inside a
[kv_heads, capacity, head_dim] cache buffer without touching the rest of the cache.
"""

from __future__ import annotations

import ctypes

import numpy as np

from specedge.runtime.backends.gpu_info import cudart_module, gpu_identity

ALIGNMENT = 256  # cudaMalloc's guarantee; the host arena keeps the same, so offsets match


class HostMemory:
    """Host arrays standing in for device memory (tests, CPU-only checks)."""

    name = "host"
    stream = 0

    def __init__(self) -> None:
        self._blocks: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
        address = -(-raw.ctypes.data // ALIGNMENT) * ALIGNMENT
        self._blocks[address] = raw
        return address

    def free(self, address: int) -> None:
        del self._blocks[address]

    def upload(self, address: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        ctypes.memmove(address, a.ctypes.data, a.nbytes)

    def download(self, address: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, address, out.nbytes)

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                height: int) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)

    def synchronize(self) -> None:
        pass


def cuda_check(result: tuple, what: str):
    """cuda-python returns (error, *values); raise on an error, return the values."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


class CudaMemory:
    """Device memory and one stream through cuda-python's runtime API."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        gpu_identity(device)  # no GPU or driver: the error says what works instead
        self.cudart = cudart_module()
        cuda_check(self.cudart.cudaSetDevice(device), "cudaSetDevice")
        self._stream_handle = cuda_check(self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.stream = int(self._stream_handle)
        self._live: set[int] = set()

    def alloc(self, nbytes: int) -> int:
        address = int(cuda_check(self.cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))
        self._live.add(address)
        return address

    def free(self, address: int) -> None:
        self._live.discard(address)
        cuda_check(self.cudart.cudaFree(address), "cudaFree")

    def upload(self, address: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_check(self.cudart.cudaMemcpyAsync(address, a.ctypes.data, a.nbytes, kind,
                                            self.stream), "cudaMemcpyAsync (upload)")
        # A pageable source may be read after this returns: wait, so `array` may change.
        self.synchronize()

    def download(self, address: int, out: np.ndarray) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(self.cudart.cudaMemcpyAsync(out.ctypes.data, address, out.nbytes, kind,
                                            self.stream), "cudaMemcpyAsync (download)")
        self.synchronize()

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                height: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda_check(self.cudart.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                              kind, self.stream), "cudaMemcpy2DAsync")

    def synchronize(self) -> None:
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        for address in list(self._live):
            self.free(address)
        cuda_check(self.cudart.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
