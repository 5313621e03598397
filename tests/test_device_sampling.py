"""The on-device sampling kernels compile (NVRTC, no GPU needed) and fail clearly.

Running them needs a GPU: scripts/gpu_check_sampling.py compares them with the host
reference there. Here (cuda-python and NVRTC from the [cuda] extra, which scripts/test.sh
installs): the shipped source compiles to PTX with every kernel in it, a compile error
carries NVRTC's log, and a missing cuda-python says what to install.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from specedge.runtime import device_sampling
from specedge.runtime.errors import BackendUnavailableError


@pytest.fixture(scope="module")
def ptx() -> str:
    return device_sampling.compile_sampling_kernels().decode()


def test_kernels_compile_to_ptx(ptx):
    assert ".target sm_90" in ptx
    for name in device_sampling.KERNELS:
        assert f".entry {name}(" in ptx, name


def test_block_size_matches_launch_bounds(ptx):
    # Every launch uses THREADS; the kernels' __launch_bounds__ must allow it.
    assert ptx.count(f".maxntid {device_sampling.THREADS}, 1, 1") == len(device_sampling.KERNELS)


def test_cubin_for_a_device_arch():
    assert device_sampling.compile_sampling_kernels("sm_87").startswith(b"\x7fELF")


def test_compile_error_carries_the_log():
    broken = 'extern "C" __global__ void k(int* out) { out[0] = undeclared_name; }'
    with pytest.raises(RuntimeError, match="undeclared_name") as info:
        device_sampling._compile(broken, "compute_90", name="broken.cu")
    assert "broken.cu" in str(info.value) and "NVRTC_ERROR_COMPILATION" in str(info.value)


def test_bad_arch_is_a_value_error():
    with pytest.raises(ValueError, match="sm_90"):
        device_sampling.compile_sampling_kernels("hopper")


def test_missing_cuda_python_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import now fails
    with pytest.raises(BackendUnavailableError, match=r"pip install 'specedge\[cuda\]'"):
        device_sampling.compile_sampling_kernels()


def test_missing_nvrtc_library_says_what_to_install(monkeypatch):
    nvrtc = importlib.import_module("cuda.bindings.nvrtc")

    def no_library():
        raise RuntimeError("libnvrtc.so.13 not found")  # what cuda-python's loader raises

    monkeypatch.setattr(nvrtc, "nvrtcVersion", no_library)
    with pytest.raises(BackendUnavailableError, match="libnvrtc.so.13 not found"):
        device_sampling.compile_sampling_kernels()


def test_device_arch_choice():
    supported = [75, 80, 86, 87, 89, 90, 100, 120]
    assert device_sampling._pick_arch(9, 0, supported) == "sm_90"
    assert device_sampling._pick_arch(8, 7, supported) == "sm_87"
    assert device_sampling._pick_arch(12, 1, supported) == "compute_120"  # newer GPU: PTX
    with pytest.raises(BackendUnavailableError):
        device_sampling._pick_arch(7, 0, supported)


def test_host_memory_is_refused():
    class HostMemory:
        name = "host"

    with pytest.raises(BackendUnavailableError, match="CUDA device memory"):
        device_sampling.DeviceSampler(HostMemory())
