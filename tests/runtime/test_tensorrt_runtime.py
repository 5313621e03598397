"""The `tensorrt` backend's own code (TrtEngine: compatibility check, one context per profile,
profile choice, shape-tensor inputs from host memory, CUDA-graph capture and replay of the
one-token step) run against a stand-in: TensorRT's runtime calls are served by ONNX Runtime
on the bundle's graph, cuda-python's graph calls by a recorder that replays what was
captured. TensorRT itself is not here; scripts/gpu_check.sh runs the real thing."""

from __future__ import annotations

import ctypes
import json
import shutil
import sys
import types

import pytest

from specedge.export.tensorrt import build as trt_build
from specedge.export.tensorrt import calls as trt_calls
from specedge.runtime import Generator, backends
from specedge.runtime.backends import engine_manifest
from specedge.runtime.backends import memory as device_memory
from specedge.runtime.backends.device_sampling import HostSampler
from specedge.runtime.bundle import graph_io
from specedge.runtime.errors import BundleError

GPU = ("NVIDIA Jetson Orin Nano", (8, 7))
TRT_VERSION = "10.3.0"


class FakeCudart:
    """cudaStreamBeginCapture .. EndCapture records work instead of running it, as CUDA does;
    cudaGraphLaunch runs the recorded work."""

    class cudaStreamCaptureMode:  # noqa: N801 - cuda-python's name
        cudaStreamCaptureModeThreadLocal = 1

    def __init__(self):
        self.recording: list | None = None
        self.captures = self.launches = 0

    def cudaStreamBeginCapture(self, stream, mode):  # noqa: N802
        self.recording = []
        return (0,)

    def cudaStreamEndCapture(self, stream):  # noqa: N802
        work, self.recording = self.recording, None
        self.captures += 1
        return (0, work)

    def cudaGraphInstantiate(self, graph, flags):  # noqa: N802
        return (0, list(graph))

    def cudaGraphLaunch(self, graph, stream):  # noqa: N802
        self.launches += 1
        for run in graph:
            run()
        return (0,)


def fake_tensorrt(cudart: FakeCudart, log: list) -> types.ModuleType:
    """The runtime half of TensorRT's Python API that TrtEngine uses; an "engine" file names
    its ONNX graph and profiles, and executing a context runs that graph with ONNX Runtime
    on the addresses the context was given."""
    import onnxruntime as ort

    trt = types.ModuleType("tensorrt")
    trt.__version__ = TRT_VERSION

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Context:
        def __init__(self, engine):
            self.engine, self.shapes, self.addresses, self.profile = engine, {}, {}, None

        def set_optimization_profile_async(self, index, stream):
            self.profile = index
            return True

        def set_input_shape(self, name, shape):
            lo, _, hi = self.engine.profiles[self.profile]["tokens"]
            if name == "input_ids" and not lo <= shape[1] <= hi:
                return False  # TensorRT refuses a shape outside the context's profile
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, address):
            self.addresses[name] = address
            return True

        def execute_async_v3(self, stream):
            session, profile = self.engine.session, self.profile
            shapes, addresses = dict(self.shapes), dict(self.addresses)
            t = shapes["input_ids"][1]

            def run():
                io = session.io_binding()
                for i in session.get_inputs():
                    dtype = "int64" if "int64" in i.type else "float32"
                    io.bind_input(i.name, "cpu", 0, dtype, list(shapes[i.name]),
                                  addresses[i.name])
                keep = ctypes.c_int64.from_address(addresses["logits_to_keep"]).value
                for o in session.get_outputs():
                    _, heads, _, dim = shapes["past_key_values.0.key"]
                    shape = ([1, keep, o.shape[2]] if o.name == "logits"
                             else [1, heads, t, dim])
                    io.bind_output(o.name, "cpu", 0, "float32", shape, addresses[o.name])
                session.run_with_iobinding(io)
                log.append((self.engine.role, profile, t))

            if cudart.recording is not None:
                cudart.recording.append(run)
            else:
                run()
            return True

    class Engine:
        def __init__(self, desc):
            self.role, self.profiles = desc["role"], desc["profiles"]
            self.session = ort.InferenceSession(desc["onnx"],
                                                providers=["CPUExecutionProvider"])
            self.names = [i.name for i in self.session.get_inputs()] + \
                [o.name for o in self.session.get_outputs()]
            self.num_io_tensors = len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def is_shape_inference_io(self, name):
            return name == "logits_to_keep"

        def create_execution_context(self):
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return Engine(json.loads(data))

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt


@pytest.fixture
def trt_bundle(tiny_bundle, tmp_path, monkeypatch):
    """A copy of the tiny bundle with "engines" built by `build_engines` (the builder call
    replaced) and the tensorrt backend's GPU, TensorRT and memory replaced."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    cudart, log = FakeCudart(), []
    trt = fake_tensorrt(cudart, log)

    def build_engine(trt_module, plan, out, cache):
        out.write_text(json.dumps({"role": plan.role, "onnx": str(plan.onnx),
                                   "profiles": [{"tokens": p["tokens"]}
                                                for p in plan.profiles]}))
        return ["logits_to_keep"]

    class FakeCudaMemory(device_memory.HostMemory):
        def __init__(self):
            super().__init__()
            self.cudart = cudart

    monkeypatch.setattr(trt_build, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_build, "gpu_identity", lambda: GPU)
    monkeypatch.setattr(trt_calls, "build_engine", build_engine)
    monkeypatch.setattr(engine_manifest, "gpu_identity", lambda: GPU)
    monkeypatch.setattr(device_memory, "CudaMemory", FakeCudaMemory)
    monkeypatch.setattr(backends, "_device_sampler", HostSampler)  # kernels: gpu_check.sh
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    trt_build.build_engines(bundle, precision="fp32", max_draft_tokens=4)
    return bundle, cudart, log


@pytest.mark.parametrize("kwargs", [
    dict(use_draft=False),
    dict(draft_tokens=3, drafter="model"),
    dict(draft_tokens=4, temperature=0.8, top_p=0.9, seed=3, drafter="model"),
])
def test_tensorrt_backend_reproduces_the_emulated_device(trt_bundle, kwargs):
    """Same logits and the same device-side choices as host-emulated: identical tokens,
    greedy and sampled (greedy ones are also ort-cpu's, tests/runtime/test_device_backend.py)."""
    bundle, cudart, log = trt_bundle
    ref = Generator.from_bundle(bundle, backend="host-emulated")
    gen = Generator.from_bundle(bundle, backend="tensorrt")
    ids = gen.codec.encode("the cat sat on the mat")
    assert len(ids) > 5  # longer than the decode profile (K_max + 1 = 5)
    a = ref.generate(prompt_ids=ids, max_new_tokens=30, **kwargs)
    b = gen.generate(prompt_ids=ids, max_new_tokens=30, **kwargs)
    assert b.token_ids == a.token_ids
    assert b.stats["backend"] == "tensorrt"
    # The prompt ran on the prefill profile (0), every later call on the decode profile (1).
    assert log[0] == ("target", 0, len(ids))
    assert {p for role, p, t in log[1:] if role == "target"} == {1}
    # One-token steps (plain decoding, or the draft's) are captured once and replayed.
    assert cudart.captures >= 1
    assert cudart.launches > cudart.captures


def test_a_call_longer_than_the_engines_max_prompt_is_chunked(trt_bundle):
    bundle, _, log = trt_bundle
    gen = Generator.from_bundle(bundle, backend="tensorrt")
    gen.target.engine.max_tokens = 8  # as if built with --max-prompt 8
    ids = gen.codec.encode("the cat sat on the mat, and the dog sat on the log")
    ref = Generator.from_bundle(bundle)
    a = ref.generate(prompt_ids=ids, max_new_tokens=5, use_draft=False)
    b = gen.generate(prompt_ids=ids, max_new_tokens=5, use_draft=False)
    chunks = [8] * ((len(ids) - 1) // 8) + [(len(ids) - 1) % 8 + 1]
    assert [t for _, _, t in log[:len(chunks)]] == chunks
    assert b.token_ids == a.token_ids


def test_an_engine_for_another_gpu_says_rebuild(trt_bundle, monkeypatch):
    bundle, _, _ = trt_bundle
    monkeypatch.setattr(engine_manifest, "gpu_identity", lambda: ("NVIDIA H200", (9, 0)))
    with pytest.raises(BundleError, match="rebuild with `specedge build"):
        Generator.from_bundle(bundle, backend="tensorrt")


def test_every_graph_tensor_gets_an_address(trt_bundle):
    bundle, _, _ = trt_bundle
    gen = Generator.from_bundle(bundle, backend="tensorrt")
    gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, use_draft=False)
    inputs, outputs = graph_io(gen.bundle.target.num_layers)
    for context in gen.target.engine.contexts:
        if context.addresses:
            assert set(context.addresses) == set(inputs + outputs)
