"""On-device sampling and verification: a thin launcher for ``kernels/sampling.cu``, and its
numpy twin.

docs/design.md#host-and-device-token-choice (device token choice: NVRTC kernels): the target's
logits stay on the GPU, and a speculative step copies back only the accept count and the
emitted token. The kernels implement :mod:`specedge.runtime.sampling` and
:mod:`specedge.runtime.speculative` (the specification) in float32 with double-precision
sums; the math is in the ``.cu`` file. sampling_kernels.py compiles, caches and loads them;
:class:`DeviceSampler` launches them on the stream of a device memory object
(``runtime/backends/memory.py``: ``name``, ``stream``, ``alloc``, ``free``, ``upload``,
``download``, ``synchronize``) through cuda-python's driver API. :class:`HostSampler` is the
same interface in numpy.

Both take the sampling settings as a :class:`specedge.runtime.config.Sampling`, validated
when it was made, and are asked to ``process`` rows only at a temperature above 0 (greedy
steps go to ``verify_greedy``).

Random numbers come from the decode loop's ``numpy.random.Generator`` on the host and are
uploaded as float64 (53 random bits, as ``rng.random()``; a float32 uniform would resolve
token probabilities only down to 2^-24). :meth:`DeviceSampler.verify_sampled` draws a fixed
K + 1 uniforms per step (layout in ``sampled_verify``), where the host loop draws
``n_accepted + 2``: both follow the target distribution exactly, but a seeded run does not
reproduce the host path token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specedge.runtime.backends.memory import cuda_check
from specedge.runtime.backends.sampling_kernels import import_cuda, load_sampling_kernels
from specedge.runtime.errors import BackendUnavailableError
from specedge.runtime.sampling import process_logits
from specedge.runtime.speculative import verify_greedy

__all__ = ["THREADS", "DeviceSampler", "HostSampler", "sampled_verify_reference"]

THREADS = 1024  # block size of every launch; SPECEDGE_THREADS (launch bounds) in the .cu


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
        driver, cudart = import_cuda("driver"), import_cuda("runtime")
        self._driver = driver
        self.memory = memory
        self.max_rows, self.max_draft = max_rows, max_draft
        # The memory object allocates through the runtime API. cudaFree(0) creates the
        # runtime's primary context if needed and makes it current on this thread; the
        # driver-API module below must live in that same context.
        cuda_check(cudart.cudaFree(0), "cudaFree(0)")
        self.arch, self._module, self._functions = load_sampling_kernels(driver)
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
        """``probs.sample`` for each row of ``[rows, vocab]`` device probabilities.

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
    CI; specedge/gpu_check/sampling.py uses it as the kernels' token-for-token reference.
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
    """First index whose cumulative weight exceeds u * total (probs.sample's rule)."""
    c = np.cumsum(w, dtype=np.float64)
    return int(np.searchsorted(c, u * c[-1], side="right"))
