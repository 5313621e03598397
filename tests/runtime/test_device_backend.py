"""The device backend's own code (arena layout, binding plan, in-place row copies, rollback,
chunked prefill, the order of a step) run for real on host memory with ONNX Runtime CPU as
the engine ("host-emulated"), checked against the ort-cpu backend."""

from __future__ import annotations

import numpy as np
import pytest
from two_samples import two_sample_pvalue

from specedge.gpu_check.two_sample import first_two_tokens
from specedge.runtime import Generator
from specedge.runtime.backends import load_backend
from specedge.runtime.backends.device import DeviceBackend, binding_plan
from specedge.runtime.backends.device_kv_cache import (
    INPUT_NAMES,
    DeviceKVCache,
    aligned_host_buffer,
    arena_layout,
    input_slots,
)
from specedge.runtime.backends.engines import OrtEngine
from specedge.runtime.backends.memory import ALIGNMENT, HostMemory
from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import ModelSpec, graph_io, load_bundle
from specedge.runtime.errors import BackendUnavailableError
from specedge.runtime.kv_cache import KVCache

SPEC = ModelSpec(path=None, num_layers=3, num_kv_heads=2, head_dim=4, vocab_size=50,
                 max_context=512, dtype="float32", file_size=1)


def test_arena_regions_are_aligned_and_disjoint():
    layout = arena_layout(SPEC, capacity=256, max_tokens=64, max_keep=9)
    regions = sorted((r.offset, r.offset + r.nbytes, n) for n, r in layout.items()
                     if n != "total")
    assert len(regions) == 2 * SPEC.num_layers + 4
    for (start, end, name), (next_start, _, _) in zip(regions, regions[1:]):
        assert start % ALIGNMENT == 0 and end <= next_start, name
    assert regions[-1][1] <= layout["total"].nbytes
    assert layout["keys.0"].nbytes == 2 * 256 * 4 * 4
    assert layout["presents"].nbytes == 2 * 3 * 2 * 64 * 4 * 4


def test_arena_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="max_keep"):
        arena_layout(SPEC, capacity=256, max_tokens=4, max_keep=9)


def _fill_presents(memory, cache, rows, t):
    for j, new in enumerate(rows):
        memory.upload(cache.present_address(j), new[:, :, :t])


def _read(memory, cache, name):
    out = np.zeros((1, SPEC.num_kv_heads, cache.capacity, SPEC.head_dim), np.float32)
    memory.download(cache.address(name), out)
    return out


def test_row_copies_match_the_host_cache_through_writes_and_rollbacks():
    rng = np.random.default_rng(0)
    memory = HostMemory()
    dev = DeviceKVCache(memory, SPEC, capacity=256, max_tokens=8, max_keep=8)
    host = KVCache(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, 256)
    for t, rollback_to in [(5, None), (3, 6), (8, None), (1, 2), (4, None)]:
        rows = rng.standard_normal((2 * SPEC.num_layers, 1, SPEC.num_kv_heads, t,
                                    SPEC.head_dim)).astype(np.float32)
        _fill_presents(memory, dev, rows, t)
        dev.write(t)
        host.write(rows)
        if rollback_to is not None:
            dev.rollback(rollback_to)
            host.rollback(rollback_to)
        assert dev.length == host.length
        for i in range(SPEC.num_layers):
            valid = slice(0, host.length)
            assert np.array_equal(_read(memory, dev, f"keys.{i}")[:, :, valid],
                                  host.keys[i][:, :, valid])
            assert np.array_equal(_read(memory, dev, f"values.{i}")[:, :, valid],
                                  host.values[i][:, :, valid])


def test_write_past_capacity_and_bad_rollback_are_refused():
    dev = DeviceKVCache(HostMemory(), SPEC, capacity=8, max_tokens=8, max_keep=1)
    dev.write(6)
    with pytest.raises(ValueError, match="KV cache full"):
        dev.write(3)
    with pytest.raises(ValueError, match="cannot roll back"):
        dev.rollback(7)


def test_binding_plan_covers_the_contract_at_arena_addresses():
    dev = DeviceKVCache(HostMemory(), SPEC, capacity=256, max_tokens=16, max_keep=9)
    plan = binding_plan(SPEC, dev, t=5, n=3)
    inputs, outputs = graph_io(SPEC.num_layers)
    assert [b.name for b in plan] == inputs + outputs
    by_name = {b.name: b for b in plan}
    assert by_name["input_ids"].shape == (1, 5)
    assert by_name["logits"].shape == (1, 3, SPEC.vocab_size)
    assert by_name["past_key_values.2.value"].shape == (1, 2, 256, 4)
    assert by_name["present.1.key"].shape == (1, 2, 5, 4)
    end = dev.base + dev.layout["total"].nbytes
    assert all(dev.base <= b.address < end for b in plan)
    assert len({b.address for b in plan}) == len(plan)
    with pytest.raises(ValueError, match="does not fit"):
        binding_plan(SPEC, dev, t=17, n=1)


@pytest.mark.parametrize("max_tokens", [9, 1000])
def test_every_bound_address_is_aligned_for_any_max_prompt(max_tokens):
    """TensorRT requires 256-byte aligned tensor addresses (NvInferRuntime.h,
    setTensorAddress). With --max-prompt 1000, 8 * max_tokens = 8000 bytes is no multiple of
    256, nor is a [2, 9, 4] float32 present."""
    dev = DeviceKVCache(HostMemory(), SPEC, capacity=1024, max_tokens=max_tokens, max_keep=5)
    plan = binding_plan(SPEC, dev, t=5, n=3)
    assert [b.name for b in plan if b.address % ALIGNMENT] == []
    slots = input_slots(max_tokens)
    ends = [(slots[n].offset, slots[n].offset + slots[n].nbytes) for n in INPUT_NAMES]
    assert all(start % ALIGNMENT == 0 for start, _ in ends)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(ends, ends[1:]))
    assert ends[-1][1] <= slots["total"].nbytes == dev.layout["inputs"].nbytes


@pytest.mark.parametrize("nbytes", [8, 100, 8008])
def test_aligned_host_buffer(nbytes):
    buffers = [aligned_host_buffer(nbytes) for _ in range(20)]
    assert all(b.ctypes.data % ALIGNMENT == 0 and b.nbytes == nbytes and not b.any()
               for b in buffers)


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    return load_bundle(tiny_bundle)


def test_forward_equals_ort_cpu_bit_for_bit(bundle):
    ref = OrtCpuBackend(bundle.target)
    dev = load_backend("host-emulated", bundle, "target")
    rc, dc = ref.new_cache(256), dev.new_cache(256)
    for ids, keep, rollback_to in [([1, 5, 9, 2, 7], 1, None), ([3, 4, 8, 6], 4, 6),
                                   ([2], 1, None), ([5, 5, 5], 2, None)]:
        expected = ref.forward(rc, ids, keep).copy()
        got = dev.forward(dc, ids, keep)
        assert np.array_equal(got, expected)
        if rollback_to is not None:
            rc.rollback(rollback_to)
            dc.rollback(rollback_to)
    assert dev.run_seconds > 0


def test_long_prompts_are_prefilled_in_chunks(bundle):
    ref = OrtCpuBackend(bundle.target)
    dev = load_backend("host-emulated", bundle, "target")
    dev.engine.max_tokens = 4  # a prompt of 11 tokens runs as 4 + 4 + 3
    calls = []
    execute = dev.engine.execute
    dev.engine.execute = lambda key, plan, hv: (calls.append(key[1]), execute(key, plan, hv))
    ids = [1, 5, 9, 2, 7, 3, 3, 8, 1, 4, 6]
    dc = dev.new_cache(256)
    got = dev.forward(dc, ids, 3)
    expected = ref.forward(ref.new_cache(256), ids, 3)
    assert calls == [4, 4, 3]
    assert dc.length == len(ids)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_the_engine_reads_host_inputs_from_aligned_slots_holding_the_staged_values(bundle):
    """What an engine may read from the host (TensorRT: the shape tensor logits_to_keep)
    sits in aligned slots holding the values uploaded for the call, max_tokens 9 or not."""
    dev = load_backend("host-emulated", bundle, "target")
    dev.engine.max_tokens = 9
    seen = []
    execute = dev.engine.execute

    def spy(key, plan, host_values):
        seen.append({name: (v.ctypes.data, v.copy()) for name, v in host_values.items()})
        execute(key, plan, host_values)

    dev.engine.execute = spy
    cache = dev.new_cache(256)
    dev.forward(cache, [1, 5, 9, 2, 7, 3, 3, 8, 1, 4, 6], 1)  # chunks of 9 and 2
    dev.forward(cache, [4, 5, 6], 2)
    assert [set(s) for s in seen] == [set(INPUT_NAMES)] * 3
    assert all(address % ALIGNMENT == 0 for s in seen for address, _ in s.values())
    assert [(int(s["past_length"][1][0]), int(s["logits_to_keep"][1][0])) for s in seen] == \
        [(0, 1), (9, 1), (11, 2)]
    assert seen[2]["input_ids"][1][:3].tolist() == [4, 5, 6]
    assert seen[2]["position_ids"][1][:3].tolist() == [11, 12, 13]


class RecordingMemory(HostMemory):
    def __init__(self):
        super().__init__()
        self.log = []

    def upload(self, address, array):
        self.log.append(("upload", array.nbytes))
        super().upload(address, array)

    def download(self, address, out):
        self.log.append(("download", out.nbytes))
        super().download(address, out)

    def copy_2d(self, dst, dst_pitch, src, src_pitch, width, height):
        self.log.append(("copy_2d", width * height))
        super().copy_2d(dst, dst_pitch, src, src_pitch, width, height)


def test_a_step_uploads_once_executes_copies_new_rows_and_downloads_logits(bundle):
    spec = bundle.target
    memory = RecordingMemory()
    dev = DeviceBackend("host-emulated", spec, OrtEngine(spec, "cpu"), memory)
    execute = dev.engine.execute
    dev.engine.execute = lambda *a: (memory.log.append(("execute", 0)), execute(*a))
    cache = dev.new_cache(256)
    dev.forward(cache, [1, 2, 3], 1)
    memory.log.clear()
    dev.forward(cache, [4, 5], 2)
    kinds = [k for k, _ in memory.log]
    tensors = 2 * spec.num_layers
    assert kinds == ["upload", "execute"] + ["copy_2d"] * tensors + ["download"]
    row_bytes = spec.num_kv_heads * 2 * spec.head_dim * 4
    # Only the 2 new rows of each tensor move, never the cache; logits: 2 rows of vocab.
    assert all(n == row_bytes for k, n in memory.log if k == "copy_2d")
    assert memory.log[-1] == ("download", 2 * spec.vocab_size * 4)


@pytest.mark.parametrize("kwargs", [
    dict(use_draft=False),
    dict(draft_tokens=3, drafter="model"),
    dict(draft_tokens=4, draft_threshold=0.3, drafter="model"),
    dict(draft_tokens=3),                      # the default drafter, lookup+model
    dict(draft_tokens=2, drafter="prompt-lookup"),
])
def test_greedy_on_host_emulated_equals_ort_cpu(tiny_bundle, kwargs):
    """Same logits bit for bit, and greedy choices on the "device" (the sampler's interface,
    served by numpy on host memory) are the host's: identical tokens."""
    ref = Generator.from_bundle(tiny_bundle)
    dev = Generator.from_bundle(tiny_bundle, backend="host-emulated")
    for prompt in ["hello world", "the cat sat on the mat"]:
        a = ref.generate(prompt, raw=True, max_new_tokens=30, **kwargs)
        b = dev.generate(prompt, raw=True, max_new_tokens=30, **kwargs)
        assert b.token_ids == a.token_ids
        assert b.stats["backend"] == "host-emulated" and b.stats["sampling_on"] == "device"
        assert a.stats["sampling_on"] == "host"
        assert b.stats["tokens_per_target_call"] == a.stats["tokens_per_target_call"]


@pytest.mark.parametrize("kwargs", [
    dict(draft_tokens=3, temperature=0.8, top_p=0.9, drafter="model"),
    dict(draft_tokens=2, temperature=1.0, top_k=20, drafter="prompt-lookup"),
])
def test_device_sampling_path_samples_the_target_distribution(tiny_bundle, kwargs):
    """The device path draws K + 1 uniforms per step (not the host's n + 2), so a seed does
    not give the host's tokens; the distribution must be the same. Two-sample chi-square on
    the first two tokens, N = 1500 generations per arm, alpha = 0.001, seeded."""
    ref = Generator.from_bundle(tiny_bundle)
    dev = Generator.from_bundle(tiny_bundle, backend="host-emulated")
    host = first_two_tokens(ref, 1500, 0, **kwargs)
    device = first_two_tokens(dev, 1500, 10_000, **kwargs)
    assert two_sample_pvalue(host, device) > 0.001


def test_more_draft_tokens_than_the_device_buffers_hold_is_a_clear_error(tiny_bundle):
    dev = Generator.from_bundle(tiny_bundle, backend="host-emulated")
    with pytest.raises(ValueError, match="draft fewer tokens"):
        dev.generate(prompt_ids=[1, 2, 3], max_new_tokens=40, draft_tokens=20,
                     temperature=1.0, drafter="model")


def test_missing_tensorrt_names_the_package_and_the_working_backend(bundle, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails as if absent
    with pytest.raises(BackendUnavailableError, match=r"pip install tensorrt.*ort-cpu"):
        load_backend("tensorrt", bundle, "target")


def test_ort_cuda_without_onnxruntime_gpu_is_a_clear_error(bundle):
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu.*'ort-cpu'"):
        load_backend("ort-cuda", bundle, "target")


def test_cuda_memory_round_trip_or_a_clear_error_without_a_gpu():
    """CI has cuda-python (the [cuda13] extra) but no GPU: the error must say what works. On a
    GPU machine the same test checks an upload / strided copy / download round trip."""
    from cuda.bindings import runtime as cudart

    from specedge.runtime.backends.memory import CudaMemory

    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count == 0:
        with pytest.raises(BackendUnavailableError, match="GPU.*ort-cpu"):
            CudaMemory()
        return
    memory = CudaMemory()
    a = np.arange(24, dtype=np.float32).reshape(3, 8)
    src, dst = memory.alloc(a.nbytes), memory.alloc(a.nbytes)
    memory.upload(src, a)
    memory.upload(dst, np.zeros_like(a))
    memory.copy_2d(dst + 8, 32, src, 32, 8, 3)  # elements 0-1 of each row -> 2-3
    out = np.zeros_like(a)
    memory.download(dst, out)
    expected = np.zeros_like(a)
    expected[:, 2:4] = a[:, 0:2]
    assert np.array_equal(out, expected)
    memory.close()


def test_unknown_backend_lists_the_known_ones(bundle):
    with pytest.raises(ValueError, match="ort-cpu, ort-cuda, tensorrt"):
        load_backend("vulkan", bundle, "target")


def test_ort_cuda_sessions_keep_fp32_matmuls_in_fp32(tiny_bundle, monkeypatch):
    """ONNX Runtime's CUDA provider would run fp32 MatMuls in TF32 (its default): the session
    asks for use_tf32=0, so an fp32 bundle keeps plain decoding's greedy tokens on a GPU."""
    import onnxruntime as ort

    from specedge.runtime.backends.ort_cpu import open_session

    seen = []
    real = ort.InferenceSession

    def session(path, options, providers):
        seen.append(providers)
        return real(path, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", session)
    spec = load_bundle(tiny_bundle).target
    open_session(spec, None, "CUDAExecutionProvider")
    open_session(spec, None, "CPUExecutionProvider")
    assert seen == [[("CUDAExecutionProvider", {"use_tf32": "0"})],
                    [("CPUExecutionProvider", {})]]
