"""The sampling kernels' image: ``kernels/sampling.cu`` compiled by NVRTC, cached on disk,
and loaded into the current CUDA context (``DeviceSampler`` in device_sampling.py launches
them).

Torch-free and cupy-free: NVRTC compiles the source at run time (``cuda.bindings.nvrtc``) and
the driver API (``cuda.bindings.driver``) loads the image.

The compiled image is cached on disk (``kernel_image``): a cubin compile takes 1.5-2.5 s
on a server core (NVRTC 13.5, x86) and a Jetson's cores are slower, every time a backend is
loaded; the image depends only on the source, the target architecture and the NVRTC version,
which together name the cache entry.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from types import ModuleType

from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.backends.gpu_info import cuda_version, install_hint
from specedge.runtime.backends.memory import cuda_check
from specedge.runtime.errors import BackendUnavailableError
from specedge.runtime.user_cache import cache_root

__all__ = ["KERNELS", "compile_sampling_kernels", "import_cuda", "kernel_cache_dir",
           "kernel_image", "kernel_source", "load_sampling_kernels"]

KERNELS = ("process_rows", "argmax_verify", "sample_rows", "sampled_verify")
CHECK_ARCH = "compute_90"  # PTX target of a GPU-free compile check
CACHE_MAGIC = b"specedge-kernel sha256="  # a cache entry: this, the image's digest, newline


def kernel_source() -> str:
    """The CUDA C source of the sampling kernels, shipped as package data."""
    return resources.files(__package__).joinpath("kernels/sampling.cu").read_text()


def compile_sampling_kernels(arch: str | None = None) -> bytes:
    """Compile the sampling kernels with NVRTC; needs no GPU.

    Args:
        arch: ``"sm_XY"`` gives a cubin for that GPU (what :class:`DeviceSampler` loads);
            ``"compute_XY"`` gives PTX; None gives ``compute_90`` PTX (a compile check).

    Returns:
        The cubin, or the NUL-terminated PTX text, as bytes.

    Raises:
        BackendUnavailableError: cuda-python's NVRTC bindings or library are missing.
        RuntimeError: the source does not compile (the message holds NVRTC's log).
    """
    return _compile(kernel_source(), arch or CHECK_ARCH)


def _compile(source: str, arch: str, name: str = "sampling.cu") -> bytes:
    if not re.fullmatch(r"(sm|compute)_\d+[af]?", arch):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', got {arch!r}")
    nvrtc = import_cuda("nvrtc")
    prog = cuda_check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                      "nvrtcCreateProgram")
    try:
        options = _options(arch)
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = cuda_check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = bytearray(size)
            cuda_check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            text = log.rstrip(b"\0").decode(errors="replace")
            raise RuntimeError(f"NVRTC could not compile {name} for {arch} "
                               f"({status.name}):\n{text}")
        if arch.startswith("sm_"):
            get_size, get = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        else:
            get_size, get = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
        image = bytearray(cuda_check(get_size(prog), get_size.__name__))
        cuda_check(get(prog, image), get.__name__)
        return bytes(image)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _options(arch: str) -> list[bytes]:
    return [f"--gpu-architecture={arch}".encode()]


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: $SPECEDGE_CACHE/kernels, or ~/.cache/specedge/kernels
    (the cache folder that `specedge export` uses too)."""
    return cache_root() / "kernels"


def kernel_image(arch: str, cache_dir: Path | None = None) -> bytes:
    """``compile_sampling_kernels(arch)``, compiled once per source, architecture and NVRTC
    version and then read from ``cache_dir`` (default :func:`kernel_cache_dir`).

    An entry carries the SHA-256 of its image, and one that does not match (a torn or
    corrupted file) is compiled again and replaced: a damaged image must never reach the
    driver. A cache that cannot be written costs a warning and the compile, nothing else.
    """
    source = kernel_source()
    nvrtc = import_cuda("nvrtc")
    major, minor = cuda_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256(b"\0".join([source.encode(), *_options(arch)])).hexdigest()[:16]
    kind = "cubin" if arch.startswith("sm_") else "ptx"
    name = f"sampling-{arch}-nvrtc{major}.{minor}-{key}.{kind}"
    path = Path(cache_dir or kernel_cache_dir()) / name
    image = _read_entry(path)
    if image is None:
        image = _compile(source, arch)
        _write_entry(path, image)
    return image


def _read_entry(path: Path) -> bytes | None:
    """The image in a cache entry, or None when it is missing or does not match its digest."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, _, image = data.partition(b"\n")
    if head != CACHE_MAGIC + hashlib.sha256(image).hexdigest().encode():
        return None
    return image


def _write_entry(path: Path, image: bytes) -> None:
    """Write a cache entry atomically (runtime/atomic_files.py), so that a reader (another process
    loading the kernels) never sees half a file."""
    try:
        atomic_write(path, CACHE_MAGIC + hashlib.sha256(image).hexdigest().encode() + b"\n"
                     + image)
    except OSError as e:
        warnings.warn(f"could not cache the compiled sampling kernels in {path.parent} ({e}); "
                      "they are compiled again on every load (set SPECEDGE_CACHE to a "
                      "writable folder)", stacklevel=3)


def import_cuda(name: str) -> ModuleType:
    """``cuda.bindings.<name>``, or a BackendUnavailableError that says what to install.

    importlib (not ``from cuda.bindings import ...``) so that a test can hide the module
    through ``sys.modules``. For NVRTC the library itself is loaded too (its own wheel,
    nvidia-cuda-nvrtc), so that a missing one fails here and not in the middle of a compile.
    """
    try:
        module = importlib.import_module(f"cuda.bindings.{name}")
        if name == "nvrtc":
            cuda_check(module.nvrtcVersion(), "nvrtcVersion")
    except (ImportError, RuntimeError) as e:  # the library loader raises a RuntimeError
        raise BackendUnavailableError(
            f"on-device sampling needs cuda-python's {name} bindings and NVIDIA's NVRTC "
            f"library ({e}); install them with: {install_hint()}") from e
    return module


def _pick_arch(major: int, minor: int, supported: Sequence[int]) -> str:
    """A cubin for the device's exact SM when NVRTC knows it, else PTX for the newest SM
    it knows below (a driver JIT-compiles PTX for newer GPUs, never for older ones).

    A cubin rather than PTX because the driver must JIT PTX, and it refuses PTX of a newer
    ISA than it knows (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): our NVRTC wheel may well be
    newer than the device's driver. A cubin needs no JIT, and CUDA's minor-version
    compatibility lets any driver of the same CUDA major version load it.
    """
    cc = 10 * major + minor
    if cc in supported:
        return f"sm_{major}{minor}"
    older = [a for a in supported if a < cc]
    if not older:
        raise BackendUnavailableError(
            f"this GPU (compute capability {major}.{minor}) is older than anything the "
            f"installed NVRTC can compile for (sm_{min(supported)} and up)")
    return f"compute_{max(older)}"


def load_sampling_kernels(driver) -> tuple[str, object, dict]:
    """The kernels for the GPU of the current CUDA context, compiled (or read from the cache)
    and loaded into that context: ``(arch, module, {kernel name: function})``, ``arch`` as
    :func:`_pick_arch` chose it. ``driver`` is cuda-python's driver module; the caller
    unloads the module (``cuModuleUnload``) when done."""
    device = cuda_check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
    attr = driver.CUdevice_attribute
    major = cuda_check(driver.cuDeviceGetAttribute(
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
    minor = cuda_check(driver.cuDeviceGetAttribute(
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
    nvrtc = import_cuda("nvrtc")
    supported = cuda_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    arch = _pick_arch(major, minor, supported)
    module, functions = _load_kernels(driver, nvrtc, arch)
    return arch, module, functions


def _load_kernels(driver, nvrtc, arch: str) -> tuple[object, dict]:
    """Compile the kernels for ``arch`` (or read them from the cache) and load them into the
    current context: ``(module, {kernel name: function})``.

    A compile error, or an image the driver refuses, is a BackendUnavailableError, on which
    the backend samples on the host (``backends._device_sampler``): the kernels save copies,
    the model still runs on the GPU. The driver refuses PTX of a newer ISA than it knows
    (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, an NVRTC newer than the driver) and an image for
    another GPU (CUDA_ERROR_NO_BINARY_FOR_GPU).
    """
    try:
        image = kernel_image(arch)
    except RuntimeError as e:  # NVRTC's error, with its log
        raise BackendUnavailableError(f"the sampling kernels do not compile: {e}") from e
    try:
        module = cuda_check(driver.cuModuleLoadData(image), "cuModuleLoadData")
    except RuntimeError as e:
        raise BackendUnavailableError(_refused(driver, nvrtc, arch, e)) from e
    try:
        return module, {name: cuda_check(driver.cuModuleGetFunction(module, name.encode()),
                                         f"cuModuleGetFunction({name})") for name in KERNELS}
    except RuntimeError as e:
        driver.cuModuleUnload(module)
        raise BackendUnavailableError(f"the sampling kernels are incomplete: {e}") from e


def _refused(driver, nvrtc, arch: str, error: Exception) -> str:
    """Why the driver refused the kernel image: which NVRTC made it, which CUDA the driver
    supports, and for PTX the fix (PTX is JIT-compiled by the driver, which must be at least
    as new as the NVRTC that wrote it; a cubin needs only the same CUDA major version)."""
    nv = cuda_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    err, drv = driver.cuDriverGetVersion()
    drv_text = f"CUDA {cuda_version(int(drv))}" if int(err) == 0 else "an unknown CUDA version"
    kind = "cubin" if arch.startswith("sm_") else "PTX"
    text = (f"the driver refused the sampling kernels ({kind} for {arch} from NVRTC "
            f"{nv[0]}.{nv[1]}; the driver supports {drv_text}): {error}")
    if kind == "PTX":
        text += ("; PTX needs a driver at least as new as NVRTC: install the NVRTC wheel of "
                 "the driver's CUDA version, or update the driver")
    return text
