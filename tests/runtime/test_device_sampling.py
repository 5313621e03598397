"""The on-device sampling kernels compile (NVRTC, no GPU needed), are cached, and fail clearly.

Running them needs a GPU: specedge/gpu_check/sampling.py compares them with the host
reference there. Here (cuda-python and NVRTC from the [cuda] extra, which scripts/test.sh
installs): the shipped source compiles to PTX with every kernel in it, a compile error
carries NVRTC's log, a missing cuda-python says what to install, the compiled image is
cached on disk and a damaged entry is compiled again, a compile error or an image the driver
refuses leaves the backend sampling on the host (a stand-in driver module plays the GPU),
and a driver too old for the installed cuda-python says which extra fits it.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings

import numpy as np
import pytest
from scipy.stats import chisquare

from specedge.runtime import atomic_files, backends
from specedge.runtime.backends import device_sampling, gpu_info, sampling_kernels
from specedge.runtime.backends.memory import HostMemory
from specedge.runtime.errors import BackendUnavailableError


@pytest.fixture(scope="module")
def ptx() -> str:
    return sampling_kernels.compile_sampling_kernels().decode()


def test_kernels_compile_to_ptx(ptx):
    assert ".target sm_90" in ptx
    for name in sampling_kernels.KERNELS:
        assert f".entry {name}(" in ptx, name


def test_block_size_matches_launch_bounds(ptx):
    # Every launch uses THREADS; the kernels' __launch_bounds__ must allow it.
    assert ptx.count(f".maxntid {device_sampling.THREADS}, 1, 1") == len(sampling_kernels.KERNELS)


def test_cubin_for_a_device_arch():
    assert sampling_kernels.compile_sampling_kernels("sm_87").startswith(b"\x7fELF")


def test_compile_error_carries_the_log():
    broken = 'extern "C" __global__ void k(int* out) { out[0] = undeclared_name; }'
    with pytest.raises(RuntimeError, match="undeclared_name") as info:
        sampling_kernels._compile(broken, "compute_90", name="broken.cu")
    assert "broken.cu" in str(info.value) and "NVRTC_ERROR_COMPILATION" in str(info.value)


def test_bad_arch_is_a_value_error():
    with pytest.raises(ValueError, match="sm_90"):
        sampling_kernels.compile_sampling_kernels("hopper")


def test_missing_cuda_python_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import now fails
    major = int(importlib.import_module("cuda.bindings").__version__.split(".")[0])
    with pytest.raises(BackendUnavailableError, match=rf"pip install 'specedge\[cuda{major}\]'"):
        sampling_kernels.compile_sampling_kernels()


def test_missing_nvrtc_library_says_what_to_install(monkeypatch):
    nvrtc = importlib.import_module("cuda.bindings.nvrtc")

    def no_library():
        raise RuntimeError("libnvrtc.so.13 not found")  # what cuda-python's loader raises

    monkeypatch.setattr(nvrtc, "nvrtcVersion", no_library)
    with pytest.raises(BackendUnavailableError, match="libnvrtc.so.13 not found"):
        sampling_kernels.compile_sampling_kernels()


def test_device_arch_choice():
    supported = [75, 80, 86, 87, 89, 90, 100, 120]
    assert sampling_kernels._pick_arch(9, 0, supported) == "sm_90"
    assert sampling_kernels._pick_arch(8, 7, supported) == "sm_87"
    assert sampling_kernels._pick_arch(12, 1, supported) == "compute_120"  # newer GPU: PTX
    with pytest.raises(BackendUnavailableError):
        sampling_kernels._pick_arch(7, 0, supported)


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


# ---- the on-disk cache of compiled kernels ---------------------------------------------------

def fake_image(source: str, arch: str, name: str = "sampling.cu") -> bytes:
    """What NVRTC would return, made up from its inputs (tests that need no real compile)."""
    return b"\x7fELF" + arch.encode() + bytes(range(256)) * 4 + str(len(source)).encode()


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The arch of every NVRTC compile; the real compiler still runs."""
    calls: list[str] = []
    real = sampling_kernels._compile

    def counting(source, arch, name="sampling.cu"):
        calls.append(arch)
        return real(source, arch, name)

    monkeypatch.setattr(sampling_kernels, "_compile", counting)
    return calls


@pytest.fixture
def fake_compiles(monkeypatch) -> list[str]:
    """Like `compiles`, with `fake_image` in place of NVRTC."""
    calls: list[str] = []

    def fake(source, arch, name="sampling.cu"):
        calls.append(arch)
        return fake_image(source, arch, name)

    monkeypatch.setattr(sampling_kernels, "_compile", fake)
    return calls


def test_second_load_does_not_compile(tmp_path, compiles):
    first = sampling_kernels.kernel_image("sm_87", tmp_path)
    second = sampling_kernels.kernel_image("sm_87", tmp_path)
    assert compiles == ["sm_87"]
    assert second == first and first.startswith(b"\x7fELF")
    assert [p.suffix for p in tmp_path.iterdir()] == [".cubin"]  # no temporary file left


def test_cache_key_is_arch_source_and_nvrtc_version(tmp_path, fake_compiles, monkeypatch):
    sampling_kernels.kernel_image("sm_87", tmp_path)
    sampling_kernels.kernel_image("sm_89", tmp_path)
    assert fake_compiles == ["sm_87", "sm_89"]
    source = sampling_kernels.kernel_source()
    monkeypatch.setattr(sampling_kernels, "kernel_source", lambda: source + "\n// edited\n")
    sampling_kernels.kernel_image("sm_87", tmp_path)
    assert fake_compiles[-1] == "sm_87" and len(fake_compiles) == 3
    nvrtc = importlib.import_module("cuda.bindings.nvrtc")
    monkeypatch.setattr(nvrtc, "nvrtcVersion", lambda: (nvrtc.nvrtcResult.NVRTC_SUCCESS, 99, 1))
    sampling_kernels.kernel_image("sm_87", tmp_path)
    assert len(fake_compiles) == 4 and len(list(tmp_path.iterdir())) == 4
    assert any("nvrtc99.1" in p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("damage", [
    lambda data: data[:-100],                               # torn write
    lambda data: data[:-1] + bytes([data[-1] ^ 1]),         # one bit of the image
    lambda data: data.replace(b"sha256=", b"sha256=0", 1),  # the header
    lambda data: b"",
])
def test_corrupt_entry_is_compiled_again_and_replaced(tmp_path, fake_compiles, damage):
    image = sampling_kernels.kernel_image("sm_87", tmp_path)
    (entry,) = tmp_path.iterdir()
    good = entry.read_bytes()
    entry.write_bytes(damage(good))
    assert sampling_kernels.kernel_image("sm_87", tmp_path) == image
    assert fake_compiles == ["sm_87", "sm_87"]  # compiled again, not read
    assert entry.read_bytes() == good


def test_unwritable_cache_warns_and_still_returns_the_image(tmp_path, fake_compiles):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not cache the compiled sampling kernels"):
        image = sampling_kernels.kernel_image("sm_87", blocker / "kernels")
    assert image == fake_image(sampling_kernels.kernel_source(), "sm_87")


def test_entry_appears_only_complete(tmp_path, fake_compiles, monkeypatch):
    # Written to a temporary file and moved into place: a failed move leaves no entry (and
    # no temporary file), never a partial one.
    def no_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_files.os, "replace", no_replace)
    with pytest.warns(UserWarning, match="disk full"):
        sampling_kernels.kernel_image("sm_87", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    assert sampling_kernels.kernel_cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("SPECEDGE_CACHE")
    assert sampling_kernels.kernel_cache_dir().parts[-3:] == (".cache", "specedge", "kernels")


# ---- loading on a GPU, with a stand-in driver ------------------------------------------------

CUresult = importlib.import_module("cuda.bindings.driver").CUresult
OK = CUresult.CUDA_SUCCESS


class StandInDriver:
    """The driver calls DeviceSampler makes, answered as a GPU of compute capability `cc`
    behind a driver of CUDA `version` would; cuModuleLoadData answers `load_error`."""

    CUdevice_attribute = importlib.import_module("cuda.bindings.driver").CUdevice_attribute
    CUstream = int

    def __init__(self, cc=(8, 7), load_error=OK, version=12060):
        self.cc, self.load_error, self.version = cc, load_error, version
        self.loaded: list[bytes] = []
        self.unloaded: list[object] = []

    def cuCtxGetDevice(self):
        return OK, 0

    def cuDeviceGetAttribute(self, attribute, device):
        major = attribute == self.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        return OK, self.cc[0] if major else self.cc[1]

    def cuDriverGetVersion(self):
        return OK, self.version

    def cuModuleLoadData(self, image):
        self.loaded.append(bytes(image))
        return self.load_error, (f"module{len(self.loaded)}" if self.load_error == OK else None)

    def cuModuleGetFunction(self, module, name):
        return OK, name

    def cuModuleUnload(self, module):
        self.unloaded.append(module)
        return (OK,)


class CudaNamedMemory(HostMemory):
    name = "cuda"  # what DeviceSampler asks of device memory; allocations stay on the host


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """Install a stand-in driver (and runtime) for DeviceSampler; NVRTC stays real, and the
    kernel cache lives in tmp_path. Returns a function that sets the driver's answers."""
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    real_import = device_sampling.import_cuda
    modules = {"runtime": types.SimpleNamespace(cudaFree=lambda address: (OK,))}

    def install(**answers) -> StandInDriver:
        modules["driver"] = StandInDriver(**answers)
        return modules["driver"]

    monkeypatch.setattr(device_sampling, "import_cuda",
                        lambda name: modules[name] if name in modules else real_import(name))
    return install


def test_device_sampler_reuses_the_cached_cubin(gpu, compiles):
    driver = gpu()
    for _ in range(2):
        sampler = device_sampling.DeviceSampler(CudaNamedMemory())
        assert sampler.arch == "sm_87" and set(sampler._functions) == set(sampling_kernels.KERNELS)
        sampler.close()
    assert compiles == ["sm_87"]  # the second sampler read the cache
    assert len(driver.loaded) == 2 and driver.loaded[0] == driver.loaded[1]
    assert driver.loaded[0].startswith(b"\x7fELF") and driver.unloaded == ["module1", "module2"]


@pytest.mark.parametrize("cc, error, words", [
    ((8, 7), CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, r"cubin for sm_87 from NVRTC \d+\.\d+; the "
     r"driver supports CUDA 12\.6\): cuModuleLoadData failed: .*CUDA_ERROR_NO_BINARY_FOR_GPU"),
    # A GPU newer than NVRTC knows gets PTX, which a driver older than NVRTC refuses.
    ((15, 0), CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, r"PTX for compute_\d+ .*"
     r"CUDA_ERROR_UNSUPPORTED_PTX_VERSION.*install the NVRTC wheel of the driver's CUDA"),
])
def test_refused_image_falls_back_to_host_sampling(gpu, fake_compiles, cc, error, words):
    driver = gpu(cc=cc, load_error=error)
    with pytest.warns(UserWarning, match="sampling on the host: the driver refused") as record:
        assert backends._device_sampler(CudaNamedMemory()) is None
    assert len(driver.loaded) == 1
    assert any(re.search(words, str(w.message)) for w in record), \
        [str(w.message) for w in record]


def test_compile_error_falls_back_to_host_sampling(gpu, monkeypatch):
    driver = gpu()
    broken = 'extern "C" __global__ void k(int* out) { out[0] = undeclared_name; }'
    monkeypatch.setattr(sampling_kernels, "kernel_source", lambda: broken)
    with pytest.warns(UserWarning, match=r"sampling on the host: .*NVRTC could not compile"
                                         r"(.|\n)*undeclared_name"):
        assert backends._device_sampler(CudaNamedMemory()) is None
    assert driver.loaded == []


def test_other_driver_failures_are_not_hidden(gpu, fake_compiles):
    # Only the kernels have a host fallback: a context that cannot be set up is an error.
    driver = gpu()
    driver.cuCtxGetDevice = lambda: (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="cuCtxGetDevice"):
            backends._device_sampler(CudaNamedMemory())


# ---- cuda-python 12 and 13: a driver too old for the installed line -------------------------

@pytest.mark.parametrize("driver, runtime, words", [
    (12060, 13050, r"this driver supports CUDA 12\.6, but the installed cuda-python is built "
     r"for CUDA 13 \(driver r580 or newer\): pip install 'specedge\[cuda12\]'"),
    (11080, 12090, r"supports CUDA 11\.8, .* built for CUDA 12 \(driver r525 or newer\): "
     r"update the driver$"),
    (12020, 12090, r"supports CUDA 12\.2, older than the CUDA 12\.9 runtime .* "
     r"'cuda-python==12\.2\.\*'"),
    (13000, 12090, None),  # a newer driver runs an older runtime
    (12090, 12090, None),
    (0, 13050, None),      # no driver: not "too old", the usual message applies
    (12060, 0, None),
])
def test_driver_too_old(driver, runtime, words):
    text = gpu_info.driver_too_old(driver, runtime)
    if words is None:
        assert text is None
    else:
        assert text is not None and re.search(words, text), text


def test_gpu_identity_names_the_extra_that_fits_an_old_driver(monkeypatch):
    # JetPack 6's driver (CUDA 12.6) under cuda-bindings 13: the runtime cannot start.
    real = importlib.import_module("cuda.bindings.runtime")
    errors = real.cudaError_t
    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.cudaError_t = errors
    runtime.cudaGetDeviceCount = lambda: (errors.cudaErrorInsufficientDriver, None)
    runtime.cudaDriverGetVersion = lambda: (errors.cudaSuccess, 12060)
    runtime.cudaRuntimeGetVersion = lambda: (errors.cudaSuccess, 13050)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    with pytest.raises(BackendUnavailableError) as info:
        gpu_info.gpu_identity()
    message = str(info.value)
    assert "pip install 'specedge[cuda12]'" in message and "r580" in message
    assert "cudaErrorInsufficientDriver" in message and "no usable CUDA GPU" not in message


@pytest.mark.parametrize("version, words", [
    ("12.9.10", r"^pip install 'specedge\[cuda12\]'$"),
    ("13.5.0", r"^pip install 'specedge\[cuda13\]'$"),
    ("14.0.0", r"specedge\[cuda13\].*specedge\[cuda12\]"),
])
def test_install_hint_follows_the_installed_line(monkeypatch, version, words):
    monkeypatch.setattr(importlib.import_module("cuda.bindings"), "__version__", version)
    assert re.search(words, gpu_info.install_hint())
