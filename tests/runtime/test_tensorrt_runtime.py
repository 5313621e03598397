"""The `tensorrt` backend's own code (TrtEngine: compatibility check, contexts and their
activation memory, profile choice, shape-tensor inputs from host memory, CUDA-graph capture,
replay, failure and clean-up) run against strict stand-ins: TensorRT's runtime calls are
served by ONNX Runtime on the bundle's graph, cuda-python's graph calls by a recorder that
replays what was captured, device memory by host buffers at addresses of their own range.

The stand-ins check what the real libraries require and return None / False where the real
API can: argument types, 256-byte alignment, a host address for a shape tensor and a device
address for every other tensor, shapes within the context's profile, a plain enqueue at the
same shapes before a capture, a replayed graph's context unchanged since capture (TensorRT's
developer guide, "CUDA Graphs"), live graphs only, and a CUDA error left by a failed capture
reported by the next enqueue until cleared. TensorRT itself is not here;
scripts/gpu_check.sh runs the real thing."""

from __future__ import annotations

import ctypes
import enum
import json
import shutil
import sys
import types

import numpy as np
import pytest

from specedge.export.tensorrt import build as trt_build
from specedge.export.tensorrt import engine_calls as trt_calls
from specedge.runtime import Generator, backends
from specedge.runtime.backends import engine_manifest
from specedge.runtime.backends import memory as device_memory
from specedge.runtime.backends.device_sampling import HostSampler
from specedge.runtime.backends.memory import ALIGNMENT
from specedge.runtime.batch import BatchGenerator, BatchRequest
from specedge.runtime.bundle import graph_io
from specedge.runtime.config import GenerationConfig
from specedge.runtime.errors import BundleError

GPU = ("NVIDIA Jetson Orin Nano", (8, 7))
TRT_VERSION = "10.3.0"
# Stand-in device addresses start here, above every host address (user space ends below
# 2**48 on x86-64 and arm64): a host address given where a device one is needed, or the
# reverse, is caught instead of silently working as it would on shared host memory.
DEVICE = 1 << 56
STREAM = 0x5EED
ACTIVATIONS = {0: 1 << 16, 1: 1 << 12}  # activation bytes a context needs, per profile


class DeviceSpace:
    """The stand-in device: live allocations, by device address."""

    def __init__(self):
        self.blocks: dict[int, tuple[np.ndarray, int]] = {}

    def alloc(self, nbytes: int) -> int:
        raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
        address = -(-raw.ctypes.data // ALIGNMENT) * ALIGNMENT + DEVICE
        self.blocks[address] = (raw, nbytes)
        return address

    def host(self, address: int, nbytes: int) -> int:
        """The host bytes behind [address, address + nbytes) of one live allocation."""
        for start, (_, size) in self.blocks.items():
            if start <= address and address + nbytes <= start + size:
                return address - DEVICE
        raise AssertionError(f"{address:#x} (+{nbytes}) is not in live device memory")


class StandInMemory:
    """CudaMemory's interface on a DeviceSpace."""

    name = "cuda"
    stream = STREAM

    def __init__(self, space: DeviceSpace, cudart):
        self.space, self.cudart = space, cudart

    def alloc(self, nbytes: int) -> int:
        return self.space.alloc(nbytes)

    def free(self, address: int) -> None:
        del self.space.blocks[address]  # KeyError on a double free

    def upload(self, address: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        ctypes.memmove(self.space.host(address, a.nbytes), a.ctypes.data, a.nbytes)

    def download(self, address: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, self.space.host(address, out.nbytes), out.nbytes)

    def copy_2d(self, dst, dst_pitch, src, src_pitch, width, height) -> None:
        for row in range(height):
            ctypes.memmove(self.space.host(dst + row * dst_pitch, width),
                           self.space.host(src + row * src_pitch, width), width)

    def synchronize(self) -> None:
        pass


class Handle:
    """A cudaGraph_t or cudaGraphExec_t: the work captured."""

    def __init__(self, work):
        self.work = work


class StandInCudart:
    """cuda-python's stream-capture and graph calls. Between cudaStreamBeginCapture and
    EndCapture work is recorded instead of run, as CUDA does; an instance runs it. `fail`
    makes one step of a capture fail: "end" (capture invalidated: error and no graph),
    "instantiate", or "enqueue" (TensorRT's enqueue fails while capturing)."""

    class cudaStreamCaptureMode(enum.IntEnum):  # noqa: N801 - cuda-python's name
        cudaStreamCaptureModeGlobal = 0
        cudaStreamCaptureModeThreadLocal = 1
        cudaStreamCaptureModeRelaxed = 2

    def __init__(self):
        self.recording: list | None = None
        self.captures = self.launches = 0
        self.graphs: set[Handle] = set()
        self.instances: set[Handle] = set()
        self.fail: str | None = None
        self.last_error = 0  # what cudaGetLastError returns and clears

    def cudaStreamBeginCapture(self, stream, mode):  # noqa: N802
        assert stream == STREAM and isinstance(mode, self.cudaStreamCaptureMode)
        assert self.recording is None, "capture begun twice"
        self.recording = []
        return (0,)

    def cudaStreamEndCapture(self, stream):  # noqa: N802
        assert stream == STREAM and self.recording is not None, "no capture to end"
        work, self.recording = self.recording, None
        self.captures += 1
        if self.fail == "end":
            self.last_error = 901  # cudaErrorStreamCaptureInvalidated
            return (901, None)
        graph = Handle(work)
        self.graphs.add(graph)
        return (0, graph)

    def cudaGraphInstantiate(self, graph, flags):  # noqa: N802
        assert graph in self.graphs and type(flags) is int
        if self.fail == "instantiate":
            self.last_error = 1
            return (1, None)
        instance = Handle(graph.work)
        self.instances.add(instance)
        return (0, instance)

    def cudaGraphDestroy(self, graph):  # noqa: N802
        self.graphs.remove(graph)  # KeyError: not a live graph
        return (0,)

    def cudaGraphExecDestroy(self, instance):  # noqa: N802
        self.instances.remove(instance)
        return (0,)

    def cudaGraphLaunch(self, instance, stream):  # noqa: N802
        assert instance in self.instances and stream == STREAM and self.recording is None
        self.launches += 1
        for run in instance.work:
            run()
        return (0,)

    def cudaGetLastError(self):  # noqa: N802
        error, self.last_error = self.last_error, 0
        return (error,)


def stand_in_tensorrt(cudart: StandInCudart, space: DeviceSpace, log: list) -> types.ModuleType:
    """The runtime half of TensorRT's Python API that TrtEngine uses; an "engine" file names
    its ONNX graph, profiles and shape inputs, and executing a context runs that graph with
    ONNX Runtime on the memory behind the addresses the context was given."""
    import onnxruntime as ort

    trt = types.ModuleType("tensorrt")
    trt.__version__ = TRT_VERSION

    class ExecutionContextAllocationStrategy(enum.IntEnum):
        STATIC = 0
        ON_PROFILE_CHANGE = 1
        USER_MANAGED = 2

    class Logger:
        WARNING = 2

        def __init__(self, level):
            assert level == Logger.WARNING

    class IExecutionContext:
        def __init__(self, engine, strategy):
            assert isinstance(strategy, ExecutionContextAllocationStrategy)
            self.engine, self.strategy = engine, strategy
            self.device_memory: tuple[int, int] | None = None
            self.profile = None
            self.shapes, self.addresses = {}, {}
            self.warm = None  # the state of the last plain enqueue
            self.tokens: list[int] = []  # tokens of each run on this context

        def set_device_memory(self, memory, size):
            assert self.strategy is ExecutionContextAllocationStrategy.USER_MANAGED
            assert type(memory) is int and type(size) is int
            assert memory >= DEVICE and memory % ALIGNMENT == 0, "needs aligned device memory"
            space.host(memory, size)
            self.device_memory = (memory, size)

        def set_optimization_profile_async(self, index, stream):
            assert type(index) is int and stream == STREAM
            if not 0 <= index < len(self.engine.profiles):
                return False
            self.profile, self.shapes = index, {}
            return True

        def set_input_shape(self, name, shape):
            assert isinstance(name, str) and isinstance(shape, (tuple, list))
            if name not in self.engine.inputs or ("set_input_shape", name) in self.engine.refuse:
                return False
            low, _, high = self.engine.profiles[self.profile]["shapes"][name]
            if len(shape) != len(low) or not all(a <= s <= b for a, s, b in
                                                 zip(low, shape, high)):
                return False  # outside the context's profile
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, address):
            assert isinstance(name, str) and type(address) is int
            if (name not in self.engine.names or address % ALIGNMENT
                    or ("set_tensor_address", name) in self.engine.refuse):
                return False
            # On a GPU the wrong kind of address is read anyway: garbage or a crash.
            if name in self.engine.shape_inputs:
                assert address < DEVICE, f"shape tensor {name} given a device address"
            else:
                assert address >= DEVICE, f"tensor {name} given a host address"
            self.addresses[name] = address
            return True

        def state(self):
            return self.profile, dict(self.shapes), dict(self.addresses)

        def execute_async_v3(self, stream):
            assert stream == STREAM
            engine = self.engine
            if cudart.last_error:
                return False  # TensorRT reports a CUDA error left by earlier work
            if self.strategy is ExecutionContextAllocationStrategy.USER_MANAGED:
                assert self.device_memory is not None, "USER_MANAGED context without memory"
                space.host(*self.device_memory)
                assert self.device_memory[1] >= ACTIVATIONS[self.profile]
            assert set(self.shapes) == set(engine.inputs), "an input without a shape"
            assert set(self.addresses) == set(engine.names), "a tensor without an address"
            # Shape-tensor values are read from host memory when the work is enqueued.
            values = {n: ctypes.c_int64.from_address(self.addresses[n]).value
                      for n in engine.shape_inputs}
            for n, v in values.items():
                low, high = engine.profiles[self.profile]["values"][n][::2]
                if not low <= v <= high:
                    return False
            state = self.state()
            capturing = cudart.recording is not None
            if capturing:
                assert self.warm == state, (
                    "capture without a plain enqueue at the same shapes and addresses first")
                if cudart.fail == "enqueue":
                    return False

            def run():
                assert self.state() == state, (
                    "graph replayed on a context whose shapes or addresses changed since capture")
                engine.run(state[1], state[2], values)
                engine.rows.append((self.profile, state[1]["input_ids"][0]))
                t = state[1]["input_ids"][1]
                self.tokens.append(t)
                log.append((engine.role, self.profile, t))

            if capturing:
                cudart.recording.append(run)
            else:
                run()
                self.warm = state
            return True

    class ICudaEngine:
        device_memory_size_v2 = max(ACTIVATIONS.values())

        def __init__(self, desc):
            self.role, self.profiles = desc["role"], desc["profiles"]
            self.shape_inputs = set(desc["shape_inputs"])
            self.session = ort.InferenceSession(desc["onnx"],
                                                providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in self.session.get_inputs()]
            self.names = self.inputs + [o.name for o in self.session.get_outputs()]
            self.num_io_tensors = len(self.names)
            self.refuse: set[tuple[str, str]] = set()  # (method, tensor) to answer False
            self.rows: list[tuple[int, int]] = []  # (profile, rows) of each run

        def get_tensor_name(self, i):
            return self.names[i]

        def is_shape_inference_io(self, name):
            return name in self.shape_inputs

        def get_device_memory_size_for_profile_v2(self, profile_index):
            assert type(profile_index) is int
            return ACTIVATIONS[profile_index]

        def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
            return IExecutionContext(self, strategy)

        def run(self, shapes, addresses, values):
            session = self.session
            io = session.io_binding()
            kept = []  # host copies of shape-tensor values, alive until the run ends
            for i in session.get_inputs():
                dtype = np.int64 if "int64" in i.type else np.float32
                shape = shapes[i.name]
                if i.name in values:
                    kept.append(np.full(shape, values[i.name], dtype))
                    address = kept[-1].ctypes.data
                else:
                    address = space.host(addresses[i.name],
                                         int(np.prod(shape)) * np.dtype(dtype).itemsize)
                io.bind_input(i.name, "cpu", 0, dtype, list(shape), address)
            keep = values.get("logits_to_keep") or ctypes.c_int64.from_address(
                space.host(addresses["logits_to_keep"], 8)).value
            rows, t = shapes["input_ids"]
            _, heads, _, dim = shapes["past_key_values.0.key"]
            for o in session.get_outputs():
                shape = ([rows, keep, o.shape[2]] if o.name == "logits"
                         else [rows, heads, t, dim])
                address = space.host(addresses[o.name], int(np.prod(shape)) * 4)
                io.bind_output(o.name, "cpu", 0, np.float32, shape, address)
            session.run_with_iobinding(io)

    class Runtime:
        def __init__(self, logger):
            assert isinstance(logger, Logger)

        def deserialize_cuda_engine(self, data):
            assert isinstance(data, bytes)
            try:
                return ICudaEngine(json.loads(data))
            except ValueError:
                return None  # not an engine: TensorRT returns None

    trt.Logger, trt.Runtime = Logger, Runtime
    trt.ICudaEngine, trt.IExecutionContext = ICudaEngine, IExecutionContext
    trt.ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
    return trt


@pytest.fixture
def trt_bundle(tiny_bundle, tmp_path, monkeypatch):
    """A copy of the tiny bundle with "engines" built by `build_engines` (the builder call
    replaced) and the tensorrt backend's GPU, TensorRT and memory replaced by stand-ins."""
    return with_engines(tiny_bundle, tmp_path, monkeypatch)


@pytest.fixture
def trt_self_bundle(tiny_self_draft_bundle, tmp_path, monkeypatch):
    """`trt_bundle` where the draft is the target: every draft is accepted."""
    return with_engines(tiny_self_draft_bundle, tmp_path, monkeypatch)


def with_engines(source, tmp_path, monkeypatch, max_batch: int = 1) -> types.SimpleNamespace:
    bundle = tmp_path / "bundle"
    shutil.copytree(source, bundle)
    cudart, space, log = StandInCudart(), DeviceSpace(), []
    trt = stand_in_tensorrt(cudart, space, log)

    def build_engine(trt_module, plan, out, cache):
        profiles = [{"shapes": p["shapes"], "values": p["values"]} for p in plan.profiles]
        out.write_text(json.dumps({"role": plan.role, "onnx": str(plan.onnx),
                                   "profiles": profiles, "shape_inputs": ["logits_to_keep"]}))
        return ["logits_to_keep"]

    monkeypatch.setattr(trt_build, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_build, "gpu_identity", lambda: GPU)
    monkeypatch.setattr(trt_calls, "build_engine", build_engine)
    monkeypatch.setattr(engine_manifest, "gpu_identity", lambda: GPU)
    monkeypatch.setattr(device_memory, "CudaMemory", lambda: StandInMemory(space, cudart))
    monkeypatch.setattr(backends, "_device_sampler", HostSampler)  # kernels: gpu_check.sh
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    trt_build.build_engines(bundle, precision="fp32", max_draft_tokens=4, max_batch=max_batch)
    return types.SimpleNamespace(root=bundle, cudart=cudart, space=space, log=log, trt=trt)


PROMPT = "the cat sat on the mat"  # longer than the decode profile (K_max + 1 = 5 tokens)


@pytest.mark.parametrize("kwargs", [
    dict(use_draft=False),
    dict(draft_tokens=3, drafter="model"),
    dict(draft_tokens=4, temperature=0.8, top_p=0.9, seed=3, drafter="model"),
])
def test_tensorrt_backend_reproduces_the_emulated_device(trt_bundle, kwargs):
    """Same logits and the same device-side choices as host-emulated: identical tokens,
    greedy and sampled (greedy ones are also ort-cpu's, tests/runtime/test_device_backend.py)."""
    ref = Generator.from_bundle(trt_bundle.root, backend="host-emulated")
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    ids = gen.codec.encode(PROMPT)
    assert len(ids) > 5
    a = ref.generate(prompt_ids=ids, max_new_tokens=30, **kwargs)
    b = gen.generate(prompt_ids=ids, max_new_tokens=30, **kwargs)
    assert b.token_ids == a.token_ids
    assert b.stats["backend"] == "tensorrt"
    log = trt_bundle.log
    # The prompt ran on the prefill profile (0), every later call on the decode profile (1).
    assert log[0] == ("target", 0, len(ids))
    assert {p for role, p, t in log[1:] if role == "target"} == {1}
    # One-token steps (plain decoding, or the draft's) are captured once and replayed.
    assert trt_bundle.cudart.captures >= 1
    assert trt_bundle.cudart.launches > trt_bundle.cudart.captures


def test_the_one_token_graph_has_a_context_of_its_own(trt_self_bundle):
    """The draft's one-token graph is replayed between its two-token catch-up calls (after
    a step whose drafts were all accepted) and the target's verifications; those run on the
    decode profile's context, never on the graph's (the stand-in fails a replay on a context
    changed since capture, and a capture without a warm-up enqueue at the same shapes). A
    second generation, on a new cache, warms up and captures again."""
    gen = Generator.from_bundle(trt_self_bundle.root, backend="tensorrt")
    ids = gen.codec.encode(PROMPT)
    gen.generate(prompt_ids=ids, max_new_tokens=20, draft_tokens=3, drafter="model")
    draft, target = gen.draft.engine, gen.target.engine
    assert set(draft.graph_context.tokens) == {1}
    assert len(draft.graph_context.tokens) > 3  # warm-up, capture's launch, replays
    assert set(draft.contexts[1].tokens) == {2}  # catch-up: bonus token and last draft
    assert max(target.contexts[1].tokens) == 4  # verifications of K = 3
    cudart = trt_self_bundle.cudart
    assert cudart.captures == 1 and cudart.launches > 1
    gen.generate(prompt_ids=ids, max_new_tokens=300, draft_tokens=3, drafter="model")
    assert cudart.captures == 2  # the new addresses were captured anew, after a warm-up


@pytest.mark.parametrize("fail", ["end", "instantiate", "enqueue"])
def test_a_failed_capture_falls_back_to_plain_runs_once_and_for_all(trt_bundle, fail):
    """Whichever step of the capture fails, the call runs without a graph, the failure is
    remembered (no capture is tried again), any graph made is destroyed, the CUDA error is
    cleared for the next enqueue, and the tokens are the same."""
    ref = Generator.from_bundle(trt_bundle.root, backend="host-emulated")
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    ids = gen.codec.encode(PROMPT)
    cudart = trt_bundle.cudart
    cudart.fail = fail
    with pytest.warns(UserWarning, match="CUDA graph capture failed"):
        b = gen.generate(prompt_ids=ids, max_new_tokens=12, use_draft=False)
    assert b.token_ids == ref.generate(prompt_ids=ids, max_new_tokens=12,
                                       use_draft=False).token_ids
    assert (cudart.captures, cudart.launches) == (1, 0)
    assert not cudart.graphs and not cudart.instances and cudart.last_error == 0
    gen.generate(prompt_ids=ids, max_new_tokens=300, use_draft=False)  # a new cache
    assert cudart.captures == 1


def test_graphs_are_destroyed_with_their_cache_and_at_close(trt_bundle):
    """Instantiation destroys the captured graph; a new cache (new addresses) destroys the
    old instance, and close() the last one and the activation memory: nothing leaks per
    generation."""
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    ids = gen.codec.encode(PROMPT)
    cudart, space = trt_bundle.cudart, trt_bundle.space
    for new_tokens in (10, 300):  # caches of 256 and 512 rows
        gen.generate(prompt_ids=ids, max_new_tokens=new_tokens, use_draft=False)
        assert not cudart.graphs
        assert len(cudart.instances) == 1  # the target's one-token graph for this cache
    assert cudart.captures == 2
    engine = gen.target.engine
    buffers = {c.device_memory[0] for c in engine.contexts + [engine.graph_context]}
    assert buffers <= set(space.blocks)
    engine.close()
    engine.close()
    assert not cudart.instances
    assert not buffers & set(space.blocks)


def test_the_profile_contexts_share_one_activation_buffer(trt_bundle):
    """The two profile contexts never run at once and get one buffer sized for every
    profile (device_memory_size_v2); the graph's context gets its own, sized for the decode
    profile, so nothing writes where the graph's kernels work between replays."""
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    for backend in (gen.target, gen.draft):
        engine = backend.engine
        prefill, decode = (c.device_memory for c in engine.contexts)
        assert prefill == decode == (prefill[0], max(ACTIVATIONS.values()))
        assert engine.graph_context.device_memory[1] == ACTIVATIONS[1]
        assert engine.graph_context.device_memory[0] != prefill[0]


def test_without_user_managed_memory_each_context_allocates_its_own(trt_bundle,
                                                                    monkeypatch):
    """TensorRT 10.0 has no device_memory_size_v2 / set_device_memory: default contexts."""
    monkeypatch.delattr(trt_bundle.trt.ICudaEngine, "device_memory_size_v2")
    ref = Generator.from_bundle(trt_bundle.root, backend="host-emulated")
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    engine = gen.target.engine
    strategies = {c.strategy.name for c in engine.contexts + [engine.graph_context]}
    assert strategies == {"STATIC"}
    ids = gen.codec.encode(PROMPT)
    assert gen.generate(prompt_ids=ids, max_new_tokens=8, use_draft=False).token_ids == \
        ref.generate(prompt_ids=ids, max_new_tokens=8, use_draft=False).token_ids


@pytest.mark.parametrize("method, tensor", [
    ("set_input_shape", "input_ids"),
    ("set_input_shape", "past_key_values.1.value"),
    ("set_tensor_address", "logits_to_keep"),
    ("set_tensor_address", "present.0.key"),
])
def test_a_refused_shape_or_address_is_an_error_naming_the_tensor(trt_bundle, method,
                                                                  tensor):
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    gen.target.engine.engine.refuse.add((method, tensor))
    with pytest.raises(BundleError, match=rf"'{tensor}'.*specedge build --bundle"):
        gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, use_draft=False)


def test_every_tensor_address_is_aligned_and_shape_tensors_are_on_the_host(trt_bundle):
    """Every address 256-byte aligned, also with a prompt length that is no multiple of 32
    (--max-prompt 1000 in bytes: 8000, not a multiple of 256); logits_to_keep at a host
    address, every other tensor at a device address (checked as given by the stand-in)."""
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    gen.target.engine.max_tokens = 9  # as if built with --max-prompt 9: 72-byte rows
    ids = gen.codec.encode(PROMPT + ", and the dog sat on the log")
    gen.generate(prompt_ids=ids, max_new_tokens=6, use_draft=False)
    engine = gen.target.engine
    for context in engine.contexts + [engine.graph_context]:
        assert context.addresses
        assert all(a % ALIGNMENT == 0 for a in context.addresses.values())
        assert context.addresses["logits_to_keep"] < DEVICE <= context.addresses["logits"]


def test_a_call_longer_than_the_engines_max_prompt_is_chunked(trt_bundle):
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    gen.target.engine.max_tokens = 8  # as if built with --max-prompt 8
    ids = gen.codec.encode("the cat sat on the mat, and the dog sat on the log")
    ref = Generator.from_bundle(trt_bundle.root)
    a = ref.generate(prompt_ids=ids, max_new_tokens=5, use_draft=False)
    b = gen.generate(prompt_ids=ids, max_new_tokens=5, use_draft=False)
    chunks = [8] * ((len(ids) - 1) // 8) + [(len(ids) - 1) % 8 + 1]
    assert [t for _, _, t in trt_bundle.log[:len(chunks)]] == chunks
    assert b.token_ids == a.token_ids


def test_an_engine_for_another_gpu_says_rebuild(trt_bundle, monkeypatch):
    monkeypatch.setattr(engine_manifest, "gpu_identity", lambda: ("NVIDIA H200", (9, 0)))
    with pytest.raises(BundleError, match="rebuild with `specedge build"):
        Generator.from_bundle(trt_bundle.root, backend="tensorrt")


def test_an_engine_tensorrt_cannot_load_says_rebuild(trt_bundle):
    engine = trt_bundle.root / "target.engine"
    engine.write_bytes(b"\0" * engine.stat().st_size)  # the recorded size, not an engine
    with pytest.raises(BundleError, match="could not load.*specedge build --bundle"):
        Generator.from_bundle(trt_bundle.root, backend="tensorrt")


def test_every_context_binds_every_graph_tensor(trt_self_bundle):
    """A prompt longer than the decode profile, draft steps whose drafts are all accepted
    (two-token catch-up calls for the draft), and plain decoding (one-token calls for the
    target): the prefill and decode contexts and the one-token graph's context of both
    engines all run, each with an address for every tensor of the graph."""
    gen = Generator.from_bundle(trt_self_bundle.root, backend="tensorrt")
    ids = gen.codec.encode(PROMPT)
    gen.generate(prompt_ids=ids, max_new_tokens=12, draft_tokens=3, drafter="model")
    gen.generate(prompt_ids=ids, max_new_tokens=4, use_draft=False)
    for backend in (gen.target, gen.draft):
        inputs, outputs = graph_io(backend.spec.num_layers)
        engine = backend.engine
        contexts = engine.contexts + [engine.graph_context]
        assert [c.profile for c in contexts] == [0, 1, 1]
        for context in contexts:
            assert context.tokens, "a context that never ran"
            assert set(context.addresses) == set(inputs + outputs)


@pytest.fixture
def trt_batch_bundle(tiny_portable_bundle, tmp_path, monkeypatch):
    """`trt_bundle` on the portable tiny bundle with engines built for four sequences a
    call (`specedge build --max-batch 4`)."""
    return with_engines(tiny_portable_bundle, tmp_path, monkeypatch, max_batch=4)


BATCH = [("hello world", dict(max_new_tokens=10, draft_tokens=2)),
         (PROMPT, dict(max_new_tokens=14, draft_tokens=3)),
         ("a, b, c!", dict(max_new_tokens=8, use_draft=False)),
         ("why?", dict(max_new_tokens=12, draft_tokens=4))]


def test_sequences_decoded_together_share_calls_on_the_decode_profile(trt_batch_bundle):
    """Four sequences on engines built with --max-batch 4: the same tokens as on the
    host-emulated device (whose greedy tokens equal plain decoding alone,
    tests/runtime/test_device_batch.py); the target ran calls of several rows on its decode
    profile, prompts on one row; the manifest records the rows each profile takes."""
    requests = [BatchRequest(prompt=p, raw=True, config=GenerationConfig(**c))
                for p, c in BATCH]
    ref = BatchGenerator(Generator.from_bundle(trt_batch_bundle.root,
                                               backend="host-emulated"), 4).generate(requests)
    gen = Generator.from_bundle(trt_batch_bundle.root, backend="tensorrt")
    out = BatchGenerator(gen, 4).generate(requests)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    runs = gen.target.engine.engine.rows
    assert max(rows for profile, rows in runs if profile == 1) >= 3
    assert {rows for profile, rows in runs if profile == 0} == {1}
    manifest = json.loads((trt_batch_bundle.root / "manifest.json").read_text())
    assert [p["rows"] for p in manifest["engines"]["target"]["profiles"]] == [[1, 1, 1],
                                                                              [1, 4, 4]]


def test_engines_built_for_one_sequence_refuse_a_batch_saying_how_to_rebuild(trt_bundle):
    gen = Generator.from_bundle(trt_bundle.root, backend="tensorrt")
    with pytest.raises(ValueError, match="--max-batch 2 --force`, or serve with --max-batch 1"):
        BatchGenerator(gen, 2)
