"""The on-device sampling kernels compile (NVRTC, no GPU needed) and fail clearly.

Running them needs a GPU: scripts/gpu_check_sampling.py compares them with the host
reference there. Here (cuda-python and NVRTC from the [cuda] extra, which scripts/test.sh
installs): the shipped source compiles to PTX with every kernel in it, a compile error
carries NVRTC's log, and a missing cuda-python says what to install.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from scipy.stats import chisquare

from specedge.runtime.backends import device_sampling
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


def test_host_sampler_layout_emits_the_target_distribution():
    """sampled_verify_reference (the kernels' uniform layout: u[i] tests x_i, u[K] draws the
    emitted token) with x ~ q: the first emitted token follows p_0 exactly
    (docs/design.md#the-speculative-step step 3).
    Chi-square goodness of fit, N = 20,000 draws per (p, q) pair, 5 pairs, alpha = 0.001
    each, seeded."""
    from specedge.runtime.backends.device_sampling import sampled_verify_reference

    rng = np.random.default_rng(7)
    for _ in range(5):
        p = rng.dirichlet(np.ones(6), size=3)
        q = rng.dirichlet(np.ones(6) * 0.5, size=2)
        counts = np.zeros(6)
        for _ in range(20_000):
            drafts = [int(rng.choice(6, p=q[0])), int(rng.choice(6, p=q[1]))]
            n, token = sampled_verify_reference(drafts, q, p, rng.random(3))
            counts[drafts[0] if n > 0 else token] += 1
        assert chisquare(counts, 20_000 * p[0]).pvalue > 0.001


def test_host_sampler_reads_and_writes_through_memory():
    from specedge.runtime.backends.memory import HostMemory
    from specedge.runtime.config import Sampling
    from specedge.runtime.sampling import process_logits

    memory = HostMemory()
    sampler = device_sampling.HostSampler(memory)
    logits = np.array([[0.0, 3.0, 1.0, -np.inf], [2.0, 0.5, 2.5, 0.0]], np.float32)
    src, dst = memory.alloc(logits.nbytes), memory.alloc(logits.nbytes)
    memory.upload(src, logits)
    assert sampler.verify_greedy(src, [1], 4) == (1, 2)
    assert sampler.verify_greedy(src, [0], 4) == (0, 1)
    sampler.process(src, 2, 4, Sampling(0.7, top_p=0.9), dst)
    probs = np.zeros_like(logits)
    memory.download(dst, probs)
    np.testing.assert_allclose(probs, process_logits(logits, 0.7, 0, 0.9), atol=1e-7)
    assert sampler.sample(dst, 2, 4, [0.0, 0.999999]) == [int(np.flatnonzero(probs[0])[0]),
                                                         int(np.flatnonzero(probs[1])[-1])]
