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
  and the one-token step (the draft's decode) captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    def __init__(self, spec: ModelSpec, device: str = "cpu", threads: int | None = None):
        from specedge.runtime.backends.ort_cpu import open_session

        provider = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[device]
        self.device = device
        self.session = open_session(spec, threads, provider)
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
        self.session.run_with_iobinding(io)

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
    """A TensorRT engine of a bundle, checked against this GPU and TensorRT version."""

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
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(
            self.spec.path.read_bytes())
        if self.engine is None:
            raise BundleError(f"TensorRT could not load {self.spec.path}: rebuild it with "
                              f"`specedge build --bundle {bundle.root} --force`")
        # One context per profile: switching a context's profile costs a synchronisation.
        self.contexts = []
        for profile in self.spec.profiles:
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(profile.index, self.stream)
            self.contexts.append(context)
        by_name = {p.name: p for p in self.spec.profiles}
        self.max_tokens = by_name["prefill"].tokens[2]
        self.max_keep = by_name["decode"].logits_to_keep[2]
        self._host_inputs = {self.engine.get_tensor_name(i)
                             for i in range(self.engine.num_io_tensors)
                             if self.engine.is_shape_inference_io(self.engine.get_tensor_name(i))}
        self._calls: dict[tuple, int] = {}
        self._graphs: dict[tuple, object] = {}
        self._contexts: dict[tuple, object] = {}  # the profile's context serving a key

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

            tokens = next(b.shape[1] for b in plan if b.name == "input_ids")
            capacity = next(b.shape[2] for b in plan if b.name.startswith("past_key_values"))
            context = self._contexts[key] = self.contexts[profile_for(self.spec, tokens,
                                                                      capacity)]
        for b in plan:
            if not b.output and not context.set_input_shape(b.name, b.shape):
                raise RuntimeError(f"{self.spec.path.name} refused input {b.name} of shape "
                                   f"{b.shape}; rebuild with `specedge build`")
            # Shape tensors (logits_to_keep feeds a Slice) are read from host memory.
            address = (host_values[b.name].ctypes.data if b.name in self._host_inputs
                       else b.address)
            context.set_tensor_address(b.name, address)
        self._calls[key] = self._calls.get(key, 0) + 1
        if key[1] == 1 and self._calls[key] == 2:
            # The draft's one-token step repeats with fixed shapes and addresses: capture it
            # once (after a first plain run did TensorRT's lazy set-up) and replay it.
            self._graphs[key] = self._capture(context)
            cuda_check(self._rt.cudaGraphLaunch(self._graphs[key], self.stream),
                       "cudaGraphLaunch")
            return
        if not context.execute_async_v3(self.stream):
            raise RuntimeError(f"TensorRT execution failed for {self.spec.path.name}")

    def _capture(self, context):
        rt = self._rt
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        cuda_check(rt.cudaStreamBeginCapture(self.stream, mode), "cudaStreamBeginCapture")
        ok = context.execute_async_v3(self.stream)
        graph = cuda_check(rt.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
        if not ok:
            raise RuntimeError(f"TensorRT execution failed while capturing "
                               f"{self.spec.path.name}")
        return cuda_check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")

    def forget(self) -> None:
        self._calls.clear()
        self._graphs.clear()
        self._contexts.clear()
