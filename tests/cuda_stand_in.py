"""cuda-python's runtime module replaced by a stand-in that reports one GPU (or an error),
for the code that asks which GPU this is (runtime/backends/gpu_info.py) on a machine
without one."""

from __future__ import annotations

import sys
import types

GPU = ("NVIDIA Jetson AGX Orin", (8, 7))


class FakeError:
    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, FakeError) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


def fake_cudart(monkeypatch, count_error="cudaSuccess", count=1):
    prop = types.SimpleNamespace(name=b"NVIDIA Jetson AGX Orin\0\0\0junk", major=8, minor=7)
    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.cudaError_t = types.SimpleNamespace(cudaSuccess=FakeError("cudaSuccess"))
    runtime.cudaGetDeviceCount = lambda: (FakeError(count_error), count)
    runtime.cudaGetDeviceProperties = lambda device: (FakeError("cudaSuccess"), prop)
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings),
                         ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
