"""Backends run one graph of a bundle: `forward(cache, token_ids, logits_to_keep)`.

Every backend implements the same call: feed T tokens at positions [cache.length,
cache.length + T), read the cache rows [0, cache.length), write the T new K/V rows into the
cache, return logits for the last `logits_to_keep` positions. Backends are chosen by name.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .bundle import ModelSpec, graph_io
from .errors import BackendUnavailableError, BundleError
from .kv_cache import KVCache

BACKENDS = ("ort-cpu",)


class OrtCpuBackend:
    """ONNX Runtime, CPU execution provider, with IO binding.

    The cache buffers, the small int inputs and the output buffers are bound by address, so a
    step allocates nothing and copies only the T new K/V rows. Bindings are redone only when
    T, the number of kept logits or the cache changes.
    """

    name = "ort-cpu"

    def __init__(self, spec: ModelSpec, threads: int | None = None):
        import onnxruntime as ort

        self.spec = spec
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(spec.path), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises several types for unreadable graphs
            raise BundleError(f"ONNX Runtime could not load {spec.path}: {e}; the file is "
                              "corrupt or not an ONNX graph: re-export the bundle") from e
        self._inputs, self._outputs = graph_io(spec.num_layers)
        _check_graph(self.session, spec, self._inputs)
        self._binding = self.session.io_binding()
        self._ids = np.zeros((1, 0), np.int64)
        self._past_length = np.zeros(1, np.int64)
        self._keep = np.zeros(1, np.int64)
        self._bound: tuple | None = None
        self.run_seconds = 0.0  # inside ONNX Runtime, for the share of time outside models
        self._scratch = np.zeros(0, np.float32)
        self._logits = np.zeros(0, np.float32)

    def new_cache(self, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity)

    def _bind(self, cache: KVCache, t: int, n: int) -> None:
        """(Re)bind every tensor for T input tokens and N kept logits."""
        b, s = self._binding, self.spec
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        self._ids = np.zeros((2, 1, t), np.int64)  # [0]: input_ids, [1]: position_ids
        for name, arr in (("input_ids", self._ids[0]), ("position_ids", self._ids[1]),
                          ("past_length", self._past_length), ("logits_to_keep", self._keep)):
            b.bind_input(name, "cpu", 0, np.int64, list(arr.shape), arr.ctypes.data)
        for i in range(s.num_layers):
            for name, buf in ((self._inputs[4 + 2 * i], cache.keys[i]),
                              (self._inputs[5 + 2 * i], cache.values[i])):
                b.bind_input(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        self._logits = np.zeros((1, n, s.vocab_size), np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, list(self._logits.shape),
                      self._logits.ctypes.data)
        row = (1, s.num_kv_heads, t, s.head_dim)
        self._scratch = np.zeros((2 * s.num_layers, *row), np.float32)
        for j, name in enumerate(self._outputs[1:]):
            b.bind_output(name, "cpu", 0, np.float32, list(row), self._scratch[j].ctypes.data)
        self._bound = (cache, t, n)  # holds the cache, so its buffers outlive the binding

    def forward(self, cache: KVCache, token_ids: list[int] | np.ndarray,
                logits_to_keep: int = 1) -> np.ndarray:
        """Run T tokens; returns logits [logits_to_keep, vocab] (a view, valid until the next
        call) and appends their K/V rows to `cache`."""
        t = len(token_ids)
        if t == 0 or not 1 <= logits_to_keep <= t:
            raise ValueError(f"need 1 <= logits_to_keep ({logits_to_keep}) <= tokens ({t})")
        if cache.length + t > cache.capacity:
            raise ValueError(f"KV cache full: {cache.length + t} rows, capacity "
                             f"{cache.capacity}")
        bound = self._bound
        if bound is None or bound[0] is not cache or bound[1:] != (t, logits_to_keep):
            self._bind(cache, t, logits_to_keep)
        self._ids[0, 0] = token_ids
        self._ids[1, 0] = np.arange(cache.length, cache.length + t)
        self._past_length[0] = cache.length
        self._keep[0] = logits_to_keep
        t0 = time.perf_counter()
        self.session.run_with_iobinding(self._binding)
        self.run_seconds += time.perf_counter() - t0
        cache.write(list(self._scratch[0::2]), list(self._scratch[1::2]))
        return self._logits[0]


def _check_graph(session, spec: ModelSpec, names: list[str]) -> None:
    """The graph must have the contract's inputs and the manifest's static sizes."""
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if set(inputs) != set(names):
        raise BundleError(f"{spec.path} does not have the bundle's inputs (expected "
                          f"{names[:5]}...); re-export the bundle")
    checks = [("num_kv_heads", inputs[names[4]][1], spec.num_kv_heads),
              ("head_dim", inputs[names[4]][3], spec.head_dim),
              ("vocab_size", session.get_outputs()[0].shape[2], spec.vocab_size)]
    for field, graph_value, manifest_value in checks:
        if isinstance(graph_value, int) and graph_value != manifest_value:
            raise BundleError(f"{spec.path} has {field} {graph_value} but the manifest says "
                              f"{manifest_value}: the manifest does not describe this graph; "
                              "re-export the bundle")


def check_threads(threads: int | None) -> int | None:
    limit = 4 * (os.cpu_count() or 1)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= limit):
        raise ValueError(f"threads must be an integer in [1, {limit}] (or None for all "
                         f"cores), got {threads!r}")
    return threads


def load_backend(name: str, spec: ModelSpec, threads: int | None = None) -> OrtCpuBackend:
    """The backend called `name` for one graph; ValueError for an unknown name."""
    check_threads(threads)
    if name == "ort-cpu":
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise BackendUnavailableError("backend 'ort-cpu' needs onnxruntime: "
                                          "pip install onnxruntime") from e
        return OrtCpuBackend(spec, threads)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
