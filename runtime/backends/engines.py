"""Engines: run one graph on tensors that already sit at given device addresses.

The device backend talks to an engine through one call, `execute(key, plan, host_values)`,
where `plan` lists every graph input and output with its address, shape and dtype, and
`key` names the plan (the same key always comes with the same addresses, so an engine may
keep what it derived from a plan: an ONNX Runtime IO binding, a captured CUDA graph).

- `OrtEngine`: ONNX Runtime with IO binding by address. On the CPU provider over
  `HostMemory` this is how CI runs the device backend; on the CUDA provider over
  `CudaMemory` it is the `ort-cuda` backend.
- `TrtEngine`: a TensorRT engine built by `specedge build`: one execution context per
  optimization profile, `set_input_shape` / `set_tensor_address` / `execute_async_v3`,
  and the one-token step (the draft's decode) captured in a CUDA graph and replayed on a
  context of its own.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from specedge.runtime.backends.cpu_placement import cpu_placement, run_placed
from specedge.runtime.backends.memory import cuda_check
from specedge.runtime.bundle import ModelSpec
from specedge.runtime.errors import BackendUnavailableError, BundleError

ORT_MAX_TOKENS = 512  # longer prompts are prefilled in chunks: bounds the presents buffer
ORT_MAX_KEEP = 16


@dataclass(frozen=True)
class TensorBinding:
    name: str
    address: int
    shape: tuple[int, ...]
    dtype: type
    output: bool


class OrtEngine:
    """ONNX Runtime on `device` "cpu" (host memory) or "cuda" (device memory)."""

    def __init__(self, spec: ModelSpec, device: str = "cpu", threads: int | None = None,
                 spinning: bool = False):
        from specedge.runtime.backends.ort_cpu import open_session

        provider = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[device]
        self.device = device
        # Spinning CPU threads each on a core of their own (cpu_placement.py).
        self.placement = cpu_placement(threads) if spinning and device == "cpu" else None
        self.session = open_session(spec, threads, provider, spinning, self.placement)
        self.max_tokens, self.max_keep = ORT_MAX_TOKENS, ORT_MAX_KEEP
        self._bindings: dict[tuple, object] = {}

    def execute(self, key: tuple, plan: list[TensorBinding],
                host_values: dict[str, np.ndarray]) -> None:
        io = self._bindings.get(key)
        if io is None:
            io = self._bindings[key] = self.session.io_binding()
            for b in plan:
                bind = io.bind_output if b.output else io.bind_input
                bind(b.name, self.device, 0, b.dtype, list(b.shape), b.address)
        run_placed(self.session, io, self.placement)

    def forget(self) -> None:
        """Drop derived state; the addresses of the next plans differ (a new cache)."""
        self._bindings.clear()


def import_tensorrt():
    """The tensorrt module, or BackendUnavailableError saying how to get it."""
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailableError(
            "TensorRT is not installed: pip install tensorrt (on Jetson it comes with "
            "JetPack); the ort-cpu backend works without it") from None
    return trt


class TrtEngine:
    """A TensorRT engine of a bundle, checked against this GPU and TensorRT version.

    Contexts (TensorRT's developer guide, "CUDA Graphs": a captured graph is tied to the
    shapes and state its context had at capture, and one plain enqueue at new shapes must
    precede a capture; like any CUDA graph it also replays the addresses it was given):
    - one per optimization profile, for every call but the one-token step (switching a
      context's profile costs a synchronisation). They never run at once (one stream), so
      they share one activation buffer;
    - `graph_context`, on the decode profile, for the one-token step alone (GRAPH_SHAPE):
      per generation its first call is a plain enqueue (the warm-up), its second is
      captured, later ones replay the graph. Nothing else runs on it, so its state at a
      replay is its state at capture; its activation buffer is its own too, so nothing
      writes where the graph's kernels work between replays.
    """

    GRAPH_SHAPE = (1, 1)  # (tokens, kept logits) of the draft's decode step

    def __init__(self, bundle, role: str, memory):
        from specedge.runtime.backends.engine_manifest import (
            check_engine_compatible,
            engine_entry,
            gpu_identity,
        )

        trt = import_tensorrt()
        self.spec = engine_entry(bundle, role)
        check_engine_compatible(self.spec, *gpu_identity(), trt.__version__)
        self._rt = memory.cudart
        self.stream = memory.stream
        self._rebuild = f"`specedge build --bundle {bundle.root} --force`"
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(
            self.spec.path.read_bytes())
        if self.engine is None:
            raise BundleError(f"TensorRT could not load {self.spec.path}: rebuild it with "
                              f"{self._rebuild}")
        by_name = {p.name: p for p in self.spec.profiles}
        self.max_tokens = by_name["prefill"].tokens[2]
        self.max_keep = by_name["decode"].logits_to_keep[2]
        self._decode = by_name["decode"].index
        self._graphs: dict[tuple, object] = {}  # key -> instantiated graph (cudaGraphExec_t)
        self._buffers: list[int] = []           # activation memory this engine allocated
        self._release = weakref.finalize(self, _release, self._rt, self._graphs, memory,
                                         self._buffers)
        if hasattr(self.engine, "device_memory_size_v2"):  # TensorRT >= 10.1
            shared = self._buffer(memory, self.engine.device_memory_size_v2)
            own = self._buffer(memory,
                               self.engine.get_device_memory_size_for_profile_v2(self._decode))
        else:
            shared = own = None  # each context allocates its own (STATIC)
        self.contexts = [self._context(trt, p.index, shared) for p in self.spec.profiles]
        self.graph_context = self._context(trt, self._decode, own)
        self._host_inputs = {self.engine.get_tensor_name(i)
                             for i in range(self.engine.num_io_tensors)
                             if self.engine.is_shape_inference_io(self.engine.get_tensor_name(i))}
        # A graph replays the shape-tensor values read at capture. Only logits_to_keep (part
        # of the key) is constant for a key: an engine that reads another input from the
        # host (its value changes every step) runs without a graph.
        self._capture_failed = not self._host_inputs <= {"logits_to_keep"}
        self._calls: dict[tuple, int] = {}
        self._contexts: dict[tuple, object] = {}  # the context serving a key

    def _buffer(self, memory, size: int) -> tuple[int, int]:
        """Activation memory for contexts: (device address, size)."""
        self._buffers.append(memory.alloc(max(size, 1)))
        return self._buffers[-1], size

    def _context(self, trt, profile: int, activations: tuple[int, int] | None):
        """An execution context on `profile`, running on `activations` (USER_MANAGED
        allocation and `set_device_memory`, TensorRT's Python API) or on memory of its own."""
        if activations is None:
            context = self.engine.create_execution_context()
        else:
            context = self.engine.create_execution_context(
                trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise BackendUnavailableError(
                f"TensorRT could not create an execution context for {self.spec.path.name} "
                "(out of GPU memory?): close other GPU programs, or use backend 'ort-cpu'")
        if activations is not None:
            context.set_device_memory(*activations)
        if not context.set_optimization_profile_async(profile, self.stream):
            raise BundleError(f"TensorRT refused optimization profile {profile} of "
                              f"{self.spec.path.name}: rebuild the engines with "
                              f"{self._rebuild}")
        return context

    def check_rows(self, rows: int) -> None:
        """ValueError saying how to rebuild unless calls of `rows` sequences fit the
        engine (batch.py, through the device backend's slot caches)."""
        from specedge.runtime.backends.engine_manifest import check_max_batch

        check_max_batch(self.spec, rows)

    def execute(self, key: tuple, plan: list[TensorBinding],
                host_values: dict[str, np.ndarray]) -> None:
        graph = self._graphs.get(key)
        if graph is not None:
            # Same key, same addresses and shapes: the captured launch is still valid; the
            # inputs it reads (ids, past_length) were uploaded to their fixed addresses.
            cuda_check(self._rt.cudaGraphLaunch(graph, self.stream), "cudaGraphLaunch")
            return
        context = self._contexts.get(key)
        if context is None:
            from specedge.runtime.backends.engine_manifest import profile_for

            rows, tokens = next(b.shape for b in plan if b.name == "input_ids")
            capacity = next(b.shape[2] for b in plan if b.name.startswith("past_key_values"))
            # Also checks the capacity, and the rows against the engine's --max-batch.
            profile = profile_for(self.spec, tokens, capacity, rows)
            context = self._contexts[key] = (
                self.graph_context if key[1:] == self.GRAPH_SHAPE and profile == self._decode
                else self.contexts[profile])
        self._bind(context, plan, host_values)
        if context is self.graph_context and not self._capture_failed:
            self._calls[key] = self._calls.get(key, 0) + 1
            if self._calls[key] == 2:  # the first call was the warm-up at these shapes
                graph = self._capture(context)
                if graph is not None:
                    self._graphs[key] = graph
                    cuda_check(self._rt.cudaGraphLaunch(graph, self.stream),
                               "cudaGraphLaunch")
                    return
                # Remembered for the engine's life: an engine whose work cannot be captured
                # fails the same way every time.
                self._capture_failed = True
                warnings.warn(f"CUDA graph capture failed for {self.spec.path.name}: its "
                              "one-token step runs without a graph (slower, same tokens)",
                              stacklevel=2)
        if not context.execute_async_v3(self.stream):
            raise RuntimeError(f"TensorRT execution failed for {self.spec.path.name}")

    def _bind(self, context, plan: list[TensorBinding],
              host_values: dict[str, np.ndarray]) -> None:
        """Every tensor's shape and address; TensorRT returns False for one it refuses."""
        for b in plan:
            if not b.output and not context.set_input_shape(b.name, b.shape):
                raise BundleError(f"TensorRT refused shape {b.shape} for input {b.name!r} of "
                                  f"{self.spec.path.name}: rebuild the engines with "
                                  f"{self._rebuild}")
            # A shape tensor (logits_to_keep feeds a Slice) is read from host memory: it gets
            # its host slot, never the device one (NvInferRuntime.h, setTensorAddress).
            address = (host_values[b.name].ctypes.data if b.name in self._host_inputs
                       else b.address)
            if not context.set_tensor_address(b.name, address):
                raise BundleError(f"TensorRT refused address {address:#x} for tensor "
                                  f"{b.name!r} of {self.spec.path.name} (a tensor of the "
                                  f"engine, 256-byte aligned): rebuild the engines with "
                                  f"{self._rebuild}; if that does not help, report this "
                                  "message as a bug")

    def _capture(self, context):
        """One enqueue on `context`, captured and instantiated; None if capture failed.
        On failure, as trtexec's TrtCudaGraph does: end the capture whatever happened,
        destroy the graph it returned, and clear the CUDA error so that the plain run that
        follows does not report it."""
        rt = self._rt
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        if int(rt.cudaStreamBeginCapture(self.stream, mode)[0]) != 0:
            rt.cudaGetLastError()
            return None
        ok = context.execute_async_v3(self.stream)
        err, graph = rt.cudaStreamEndCapture(self.stream)  # None when capture was invalidated
        instance = None
        if ok and int(err) == 0:
            err, instance = rt.cudaGraphInstantiate(graph, 0)
        if graph is not None:  # an instance does not need the graph it was made from
            cuda_check(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
        if instance is None or int(err) != 0:
            rt.cudaGetLastError()
            return None
        return instance

    def forget(self) -> None:
        """Drop what was derived from the last cache's addresses, destroying its graphs."""
        _destroy_graphs(self._rt, self._graphs)
        self._calls.clear()
        self._contexts.clear()

    def close(self) -> None:
        """Destroy the graphs and free the activation memory; the engine is unusable after
        (idempotent; also run when the engine is garbage-collected)."""
        self._release()


def _destroy_graphs(rt, graphs: dict) -> None:
    # A graph still running when destroyed is freed when it completes (cudaGraphExecDestroy).
    for key in list(graphs):
        cuda_check(rt.cudaGraphExecDestroy(graphs.pop(key)), "cudaGraphExecDestroy")


def _release(rt, graphs: dict, memory, buffers: list[int]) -> None:
    _destroy_graphs(rt, graphs)
    for address in buffers:
        memory.free(address)
    buffers.clear()
