"""On-device sampling and verification: a thin launcher for ``kernels/sampling.cu``.

docs/design.md#host-and-device-token-choice (device token choice: NVRTC kernels): the target's
logits stay
on the GPU, and a speculative step copies back only the accept count and the emitted token.
The kernels implement :mod:`specedge.runtime.sampling` and :mod:`specedge.runtime.speculative`
(the specification) in float32 with double-precision sums; the math is in the ``.cu`` file.

Torch-free and cupy-free: NVRTC compiles the source at run time (``cuda.bindings.nvrtc``) and
the driver API (``cuda.bindings.driver``) loads it and launches on the stream of a device
memory object (``runtime/backends/memory.py``: ``name``, ``stream``, ``alloc``, ``free``,
``upload``, ``download``, ``synchronize``).

The compiled image is cached on disk (``kernel_image``): a cubin compile takes 1.5-2.5 s
on a server core (NVRTC 13.5, x86) and a Jetson's cores are slower, every time a backend is
loaded; the image depends only on the source, the target architecture and the NVRTC version,
which together name the cache entry.

Random numbers come from the decode loop's ``numpy.random.Generator`` on the host and are
uploaded as float64 (53 random bits, as ``rng.random()``; a float32 uniform would resolve
token probabilities only down to 2^-24). :meth:`DeviceSampler.verify_sampled` draws a fixed
K + 1 uniforms per step (layout in ``sampled_verify``), where the host loop draws
``n_accepted + 2``: both follow the target distribution exactly, but a seeded run does not
reproduce the host path token for token.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from types import ModuleType

import numpy as np

from specedge.runtime.backends.gpu_info import cuda_version, install_hint
from specedge.runtime.backends.memory import cuda_check
from specedge.runtime.errors import BackendUnavailableError
from specedge.runtime.files import atomic_write
from specedge.runtime.sampling import process_logits
from specedge.runtime.speculative import verify_greedy

__all__ = ["KERNELS", "DeviceSampler", "HostSampler", "compile_sampling_kernels",
           "kernel_cache_dir", "kernel_image", "kernel_source"]

KERNELS = ("process_rows", "argmax_verify", "sample_rows", "sampled_verify")
THREADS = 1024  # block size of every launch; SPECEDGE_THREADS (launch bounds) in the .cu
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
    nvrtc = _import_cuda("nvrtc")
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
    root = os.environ.get("SPECEDGE_CACHE") or Path.home() / ".cache" / "specedge"
    return Path(root) / "kernels"


def kernel_image(arch: str, cache_dir: Path | None = None) -> bytes:
    """``compile_sampling_kernels(arch)``, compiled once per source, architecture and NVRTC
    version and then read from ``cache_dir`` (default :func:`kernel_cache_dir`).

    An entry carries the SHA-256 of its image, and one that does not match (a torn or
    corrupted file) is compiled again and replaced: a damaged image must never reach the
    driver. A cache that cannot be written costs a warning and the compile, nothing else.
    """
    source = kernel_source()
    nvrtc = _import_cuda("nvrtc")
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
    """Write a cache entry atomically (runtime/files.py), so that a reader (another process
    loading the kernels) never sees half a file."""
    try:
        atomic_write(path, CACHE_MAGIC + hashlib.sha256(image).hexdigest().encode() + b"\n"
                     + image)
    except OSError as e:
        warnings.warn(f"could not cache the compiled sampling kernels in {path.parent} ({e}); "
                      "they are compiled again on every load (set SPECEDGE_CACHE to a "
                      "writable folder)", stacklevel=3)


def _import_cuda(name: str) -> ModuleType:
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


class DeviceSampler:
    """The sampling kernels loaded on the current CUDA device, launched on ``memory.stream``.

    Methods take device addresses of float32 row-major ``[rows, vocab]`` buffers. Launches
    are asynchronous; the methods that return tokens wait for the stream (one small
    download). Small scratch buffers (draft ids, uniforms, results) are allocated once here.
    Call :meth:`close` to unload the module and free them.
    """

    def __init__(self, memory, max_rows: int = 64, max_draft: int = 64):
        if getattr(memory, "name", None) != "cuda":
            raise BackendUnavailableError(
                f"DeviceSampler needs CUDA device memory, got {getattr(memory, 'name', memory)!r}"
                "; sample on the host (runtime/sampling.py) instead")
        driver, cudart = _import_cuda("driver"), _import_cuda("runtime")
        self._driver = driver
        self.memory = memory
        self.max_rows, self.max_draft = max_rows, max_draft
        # The memory object allocates through the runtime API. cudaFree(0) creates the
        # runtime's primary context if needed and makes it current on this thread; the
        # driver-API module below must live in that same context.
        cuda_check(cudart.cudaFree(0), "cudaFree(0)")
        device = cuda_check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
        attr = driver.CUdevice_attribute
        major = cuda_check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
        minor = cuda_check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
        nvrtc = _import_cuda("nvrtc")
        supported = cuda_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
        self.arch = _pick_arch(major, minor, supported)
        self._module, self._functions = _load_kernels(driver, nvrtc, self.arch)
        self._stream = driver.CUstream(int(memory.stream))
        # Host staging arrays live as long as the sampler: an upload is asynchronous and
        # its source must outlive it (every method ends with a download, which waits).
        self._ids = np.zeros(max(max_draft, 1), np.int32)
        self._uniforms = np.zeros(max(max_rows, max_draft + 1), np.float64)
        self._out = np.zeros(max(max_rows, 2), np.int32)
        self._ids_ptr = memory.alloc(self._ids.nbytes)
        self._uniforms_ptr = memory.alloc(self._uniforms.nbytes)
        self._out_ptr = memory.alloc(self._out.nbytes)

    def process(self, logits_ptr: int, rows: int, vocab: int, sampling, probs_ptr: int) -> None:
        """``process_logits`` on device: ``[rows, vocab]`` logits -> float32 probabilities.

        ``sampling`` has ``temperature`` (> 0), ``top_k`` and ``top_p`` (a
        :class:`specedge.runtime.config.Sampling`). Asynchronous. A row with a NaN, a +inf
        or no finite logit (the host raises ValueError) comes out all NaN, and
        :meth:`sample` then raises for it.
        """
        self._check_rows(rows, vocab)
        if not np.float32(sampling.temperature) > 0:  # the kernel divides in float32
            raise ValueError(f"process: temperature must be > 0, got {sampling.temperature!r} "
                             "(greedy decoding uses verify_greedy)")
        if sampling.top_k < 0 or not 0.0 <= sampling.top_p <= 1.0:
            raise ValueError(f"process: need top_k >= 0 and top_p in [0, 1], got "
                             f"{sampling.top_k!r}, {sampling.top_p!r}")
        self._launch("process_rows", rows, np.uint64(logits_ptr), np.int32(rows),
                     np.int32(vocab), np.float32(sampling.temperature),
                     np.int32(sampling.top_k), np.float64(sampling.top_p), np.uint64(probs_ptr))

    def verify_greedy(self, logits_ptr: int, draft_ids: Sequence[int],
                      vocab: int) -> tuple[int, int]:
        """``speculative.verify_greedy`` on ``[K + 1, vocab]`` device logits (or probs).

        Returns ``(n_accepted, next_token)``; raises ValueError for a row whose argmax is
        NaN or -inf, as the host does.
        """
        k = self._upload_ids(draft_ids)
        self._check_rows(k + 1, vocab)
        self._launch("argmax_verify", 1, np.uint64(logits_ptr), np.int32(k), np.int32(vocab),
                     np.uint64(self._ids_ptr), np.uint64(self._out_ptr))
        n, token = self._results(2)
        if n < 0:
            raise ValueError(f"verify_greedy: target row {token} is all-masked (-inf) or "
                             "contains NaN; check the target model output and any logit masks")
        return n, token

    def sample(self, probs_ptr: int, rows: int, vocab: int,
               uniforms: Sequence[float]) -> list[int]:
        """``sampling.sample`` for each row of ``[rows, vocab]`` device probabilities.

        ``uniforms``: one value in ``[0, 1)`` per row (e.g. ``rng.random(rows)``).
        Raises ValueError for a row without a positive finite total.
        """
        u = np.asarray(uniforms, dtype=np.float64)
        self._check_rows(rows, vocab, self.max_rows)
        if u.shape != (rows,) or not ((u >= 0) & (u < 1)).all():
            raise ValueError(f"sample: need {rows} uniforms in [0, 1), got {uniforms!r}")
        self._uniforms[:rows] = u
        self.memory.upload(self._uniforms_ptr, self._uniforms[:rows])
        self._launch("sample_rows", rows, np.uint64(probs_ptr), np.int32(rows),
                     np.int32(vocab), np.uint64(self._uniforms_ptr), np.uint64(self._out_ptr))
        tokens = self._results(rows)
        bad = [r for r, t in enumerate(tokens) if t < 0]
        if bad:
            raise ValueError(f"sample: row(s) {bad} have no positive finite probability mass "
                             "(all-masked, or NaN / +inf logits given to process)")
        return tokens

    def verify_sampled(self, p_ptr: int, q_ptr: int | None, draft_ids: Sequence[int],
                       vocab: int, rng: np.random.Generator) -> tuple[int, int]:
        """``speculative.verify_sampled`` on device probabilities.

        Args:
            p_ptr: target probabilities ``[K + 1, vocab]`` (float32, device).
            q_ptr: draft probabilities ``[K, vocab]``, or None for a model-free draft
                (one-hot q: docs/design.md#the-speculative-step step 6).
            draft_ids: the K drafted tokens.
            vocab: row length.
            rng: the decode loop's generator; exactly K + 1 ``random()`` draws per call.

        Returns:
            ``(n_accepted, next_token)``.
        """
        bad = [(i, int(x)) for i, x in enumerate(draft_ids) if not 0 <= int(x) < vocab]
        if bad:
            i, x = bad[0]
            raise ValueError(f"verify_sampled: draft token {x} at position {i} is not in "
                             f"[0, {vocab})")
        k = self._upload_ids(draft_ids)
        self._check_rows(k + 1, vocab)
        self._uniforms[:k + 1] = rng.random(k + 1)
        self.memory.upload(self._uniforms_ptr, self._uniforms[:k + 1])
        self._launch("sampled_verify", 1, np.uint64(p_ptr), np.uint64(q_ptr or 0),
                     np.int32(k), np.int32(vocab), np.uint64(self._ids_ptr),
                     np.uint64(self._uniforms_ptr), np.uint64(self._out_ptr))
        n, token = self._results(2)
        if n < 0:
            raise ValueError("verify_sampled: a target probability row has no positive finite "
                             "mass (all-masked, or NaN / +inf logits given to process)")
        return n, token

    def close(self) -> None:
        """Unload the module and free the scratch buffers (idempotent)."""
        if getattr(self, "_module", None) is None:
            return
        self.memory.synchronize()
        for ptr in (self._ids_ptr, self._uniforms_ptr, self._out_ptr):
            self.memory.free(ptr)
        cuda_check(self._driver.cuModuleUnload(self._module), "cuModuleUnload")
        self._module = None

    def __enter__(self) -> DeviceSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _launch(self, name: str, grid: int, *args: np.generic) -> None:
        # kernelParams is an array of pointers, one to each argument's value (copied at the
        # launch), so each argument sits in a one-element array of the kernel's C type.
        values = [np.array([a]) for a in args]
        pointers = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        launch = self._driver.cuLaunchKernel(self._functions[name], grid, 1, 1, THREADS, 1, 1,
                                             0, self._stream, pointers.ctypes.data, 0)
        cuda_check(launch, f"cuLaunchKernel({name})")

    def _upload_ids(self, draft_ids: Sequence[int]) -> int:
        k = len(draft_ids)
        if k > self.max_draft:
            raise ValueError(f"{k} draft tokens exceed this sampler's max_draft={self.max_draft}")
        if k:
            self._ids[:k] = draft_ids
            self.memory.upload(self._ids_ptr, self._ids[:k])
        return k

    def _results(self, count: int) -> list[int]:
        out = self._out[:count]
        self.memory.download(self._out_ptr, out)  # waits for the stream
        return [int(v) for v in out]

    def _check_rows(self, rows: int, vocab: int, limit: int | None = None) -> None:
        limit = rows if limit is None else limit
        if not 1 <= rows <= limit or vocab < 1:
            raise ValueError(f"need 1 <= rows <= {limit} and vocab >= 1, got rows={rows}, "
                             f"vocab={vocab}")


class HostSampler:
    """DeviceSampler's interface and uniform layout in numpy, on any memory object.

    The host-emulated backend samples through it, so the device path of the loop runs in
    CI; scripts/gpu_check_sampling.py uses it as the kernels' token-for-token reference.
    """

    def __init__(self, memory):
        self.memory = memory

    def _rows(self, ptr: int, rows: int, vocab: int) -> np.ndarray:
        out = np.empty((rows, vocab), np.float32)
        self.memory.download(ptr, out)
        return out

    def process(self, logits_ptr: int, rows: int, vocab: int, sampling, probs_ptr: int) -> None:
        """Like the kernel, an invalid row (NaN, +inf, nothing finite) becomes all NaN and
        `sample` / `verify_sampled` raise for it."""
        logits = self._rows(logits_ptr, rows, vocab)
        probs = np.full(logits.shape, np.nan, np.float32)
        valid = np.isfinite(logits.max(axis=1))  # NaN propagates through max
        if valid.any():
            probs[valid] = process_logits(logits[valid], sampling.temperature,
                                          sampling.top_k, sampling.top_p)
        self.memory.upload(probs_ptr, probs)

    def verify_greedy(self, logits_ptr: int, draft_ids: Sequence[int],
                      vocab: int) -> tuple[int, int]:
        return verify_greedy(draft_ids, self._rows(logits_ptr, len(draft_ids) + 1, vocab))

    def sample(self, probs_ptr: int, rows: int, vocab: int,
               uniforms: Sequence[float]) -> list[int]:
        probs = self._rows(probs_ptr, rows, vocab)
        _check_mass(probs, "sample")
        return [_inverse_cdf(p, u) for p, u in zip(probs, uniforms)]

    def verify_sampled(self, p_ptr: int, q_ptr: int | None, draft_ids: Sequence[int],
                       vocab: int, rng: np.random.Generator) -> tuple[int, int]:
        k = len(draft_ids)
        p = self._rows(p_ptr, k + 1, vocab).astype(np.float64)
        q = None if q_ptr is None else self._rows(q_ptr, k, vocab).astype(np.float64)
        _check_mass(p, "verify_sampled")
        return sampled_verify_reference(draft_ids, q, p, rng.random(k + 1))


def sampled_verify_reference(draft_ids: Sequence[int], q: np.ndarray | None, p: np.ndarray,
                             u: np.ndarray) -> tuple[int, int]:
    """``sampled_verify``'s uniform layout: u[i] tests x_i (accept iff u_i q_i(x_i) <
    p_i(x_i)), u[K] draws the one emitted token (residual after a rejection, else bonus)."""
    k = len(draft_ids)
    for i, x in enumerate(draft_ids):
        q_x = 1.0 if q is None else q[i, x]
        if u[i] * q_x < p[i, x]:
            continue
        if q is None:
            w = p[i].copy()
            w[x] = 0.0
        else:
            w = np.maximum(p[i] - q[i], 0.0)
        return i, _inverse_cdf(w if w.sum() > 0 else p[i], u[k])
    return k, _inverse_cdf(p[k], u[k])


def _check_mass(probs: np.ndarray, what: str) -> None:
    total = probs.sum(axis=1)
    bad = np.flatnonzero(~(np.isfinite(total) & (total > 0))).tolist()
    if bad:
        raise ValueError(f"{what}: row(s) {bad} have no positive finite probability mass "
                         "(all-masked, or NaN / +inf logits given to process)")


def _inverse_cdf(w: np.ndarray, u: float) -> int:
    """First index whose cumulative weight exceeds u * total (sampling.sample's rule)."""
    c = np.cumsum(w, dtype=np.float64)
    return int(np.searchsorted(c, u * c[-1], side="right"))
