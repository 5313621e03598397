"""The GPU check's parts that run the device backend and its engines, each against the host:
the device KV cache (`device_kv`), the device loop with ONNX Runtime CPU standing in for the
engine (`device_loop`), ONNX Runtime's CUDA provider (`ort_cuda`) and TensorRT engines
(`tensorrt`); and the tiny bundle they run (`tiny_bundle`). Engines are judged against
'ort-cpu' by comparison.py.
"""

from __future__ import annotations

import shutil
import time
import traceback
from pathlib import Path

import numpy as np

from specedge.gpu_check.comparison import BATCH_CASES, compare_batch, compare_generators


def check_device_kv(memory) -> dict:
    """Random writes and rollbacks through DeviceKVCache on the GPU vs the host KVCache."""
    from specedge.runtime.backends.device_kv_cache import DeviceKVCache
    from specedge.runtime.bundle import ModelSpec
    from specedge.runtime.kv_cache import KVCache

    spec = ModelSpec(path=None, num_layers=4, num_kv_heads=8, head_dim=128,
                     vocab_size=128256, max_context=4096, dtype="float32", file_size=1)
    rng = np.random.default_rng(0)
    capacity, max_tokens = 1024, 64
    dev = DeviceKVCache(memory, spec, capacity, max_tokens, 9)
    host = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, capacity)
    write_seconds, steps, mismatches = [], 0, 0
    while host.length + max_tokens < capacity:
        t = int(rng.integers(1, max_tokens + 1))
        rows = rng.standard_normal((2 * spec.num_layers, 1, spec.num_kv_heads, t,
                                    spec.head_dim)).astype(np.float32)
        for j in range(2 * spec.num_layers):
            memory.upload(dev.present_address(j), rows[j])
        t0 = time.perf_counter()
        dev.write(t)
        memory.synchronize()
        write_seconds.append(time.perf_counter() - t0)
        host.write(rows)
        if rng.random() < 0.5:
            back = int(rng.integers(max(0, host.length - t), host.length + 1))
            dev.rollback(back)
            host.rollback(back)
        steps += 1
    out = np.zeros((1, spec.num_kv_heads, capacity, spec.head_dim), np.float32)
    for i in range(spec.num_layers):
        for name, ref in ((f"keys.{i}", host.keys[i]), (f"values.{i}", host.values[i])):
            memory.download(dev.address(name), out)
            mismatches += int(not np.array_equal(out[:, :, :host.length],
                                                  ref[:, :, :host.length]))
    dev.close()
    return {"status": "pass" if mismatches == 0 else "fail", "steps": steps,
            "final_length": host.length, "tensors_mismatching": mismatches,
            "median_write_us": round(1e6 * float(np.median(write_seconds)), 1)}


def tiny_bundle(root: Path, precision: str = "fp32") -> Path:
    """The tiny Llama of tiny_checkpoints.py (the tests' model too) exported into `root` at
    `precision` (torch + transformers needed), once: root/tiny-bundle, or
    root/tiny-bundle-fp16."""
    out = root / ("tiny-bundle" if precision == "fp32" else f"tiny-bundle-{precision}")
    if (out / "manifest.json").is_file():
        return out
    from specedge.export.bundle_writer import export_bundle
    from specedge.gpu_check.tiny_checkpoints import save_tiny

    checkpoint = root / "tiny-llama"
    if not (checkpoint / "config.json").is_file():
        checkpoint = save_tiny(checkpoint, "llama")
    export_bundle(str(checkpoint), out, draft_layers=1, precision=precision)
    return out


class HostEngineOnDevice:
    """ONNX Runtime CPU serving a plan whose addresses are device memory: inputs (the whole
    KV cache too) are downloaded, the graph runs on host copies, outputs are uploaded. Slow;
    it exists so that the device loop (arena, row copies, kernels, device token choice) can
    run on a GPU where neither TensorRT nor onnxruntime-gpu is installed."""

    def __init__(self, spec, memory):
        from specedge.runtime.backends.engines import OrtEngine

        self.ort, self.memory = OrtEngine(spec, "cpu"), memory
        self.max_tokens, self.max_keep = self.ort.max_tokens, self.ort.max_keep
        self._host: dict[tuple, list] = {}

    def execute(self, key, plan, host_values) -> None:
        from specedge.runtime.backends.engines import TensorBinding

        pairs = self._host.get(key)
        if pairs is None:
            pairs = self._host[key] = [(b, np.empty(b.shape, b.dtype)) for b in plan]
        for b, arr in pairs:
            if not b.output:
                self.memory.download(b.address, arr)
        self.ort.execute(key, [TensorBinding(b.name, arr.ctypes.data, b.shape, b.dtype,
                                             b.output) for b, arr in pairs], host_values)
        for b, arr in pairs:
            if b.output:
                self.memory.upload(b.address, arr)

    def forget(self) -> None:
        self.ort.forget()
        self._host.clear()


def device_generator(bundle: Path, memory_class, sampler_class,
                     engine_class=HostEngineOnDevice):
    """A Generator on DeviceBackends over `memory_class` memory, with `engine_class` (an
    ONNX Runtime CPU graph reading device addresses) as the engine and the kernels
    (`sampler_class`) choosing tokens next to the logits."""
    from specedge.runtime import Generator
    from specedge.runtime.backends.device import DeviceBackend
    from specedge.runtime.bundle import load_bundle
    from specedge.runtime.text import TextCodec

    b = load_bundle(bundle)
    backends = []
    for role in ("target", "draft"):
        spec, memory = getattr(b, role), memory_class()
        backends.append(DeviceBackend("device-loop", spec, engine_class(spec, memory),
                                      memory, sampler_class(memory)))
    return Generator(b, *backends, TextCodec(b))


def check_device_loop(bundle: Path, memory_class, sampler_class) -> dict:
    """The whole device path but the engine, vs ort-cpu: the engine is ONNX Runtime CPU on
    the same fp32 graph, so the tokens must be identical."""
    from specedge.runtime import Generator

    ref = Generator.from_bundle(bundle)
    report = compare_generators(ref, device_generator(bundle, memory_class, sampler_class),
                                "fp32", sampled_draws=600)
    # Sequences decoded together: the slots' arena, the row copies of a call on several
    # slots and the slots' resize, on device memory.
    report["batch"] = compare_batch(ref, device_generator(bundle, memory_class,
                                                          sampler_class))
    if report["batch"]["status"] == "fail":
        report["status"] = "fail"
    return report


def check_ort_cuda(info: dict, work: Path) -> dict:
    if "CUDAExecutionProvider" not in (info.get("onnxruntime_providers") or []):
        return {"status": "not run", "reason": "onnxruntime-gpu (CUDAExecutionProvider) is "
                "not installed"}
    from specedge.runtime import Generator

    bundle = tiny_bundle(work)
    return compare_generators(Generator.from_bundle(bundle),
                              Generator.from_bundle(bundle, backend="ort-cuda"),
                              "fp32")  # its sessions ask for use_tf32=0 (backends/ort_cpu.py)


def check_tensorrt(info: dict, work: Path, smollm2: str | None) -> dict:
    """Engines for the tiny bundle in fp32 and, from its fp16 export (which TensorRT 11's
    strongly typed build needs), in fp16; for SmolLM2 in fp16 with --smollm2-bundle. Each
    against ort-cpu on the fp32 graph of the same weights (SmolLM2: the bundle given)."""
    if info["tensorrt"] is None:
        return {"status": "not run", "reason": "TensorRT is not importable on this machine"}
    from specedge.export.tensorrt.build import build_engines
    from specedge.runtime import Generator

    fp32 = tiny_bundle(work)
    # (label, bundle the engines are built for, engine precision, ort-cpu's bundle); the
    # tiny ones are built on copies: engines are written into the bundle.
    builds = [("tiny", "fp32"), ("tiny-fp16", "fp16")]
    report: dict = {"status": "pass"}
    targets = []
    for label, precision in builds:
        try:
            source = tiny_bundle(work, precision)
        except ImportError as e:
            report[label] = {"status": "not run", "reason": f"no {precision} tiny bundle and "
                             f"no way to export one here ({e}): run --prepare on a machine "
                             "with torch and pass --tiny-bundle"}
            continue
        except Exception as e:  # the export broke: report it, build the others
            report[label] = {"status": "fail", "error": f"exporting the {precision} tiny "
                             f"bundle: {type(e).__name__}: {e}"}
            report["status"] = "fail"
            continue
        shutil.copytree(source, work / f"{label}-trt", dirs_exist_ok=True)
        targets.append((label, work / f"{label}-trt", precision, fp32))
    if smollm2:
        targets.append(("smollm2", Path(smollm2), "fp16", Path(smollm2)))
    else:
        report["smollm2"] = {"status": "not run", "reason": "pass --smollm2-bundle DIR"}
    if any(label == "tiny" for label, *_ in targets):  # engines for four sequences a call
        shutil.copytree(fp32, work / "tiny-batch-trt", dirs_exist_ok=True)
        targets.append(("tiny-batch", work / "tiny-batch-trt", "fp32", fp32))
    for label, bundle, precision, reference in targets:
        t0 = time.perf_counter()
        batch = label == "tiny-batch"
        try:
            build_engines(bundle, precision=precision,
                          max_batch=len(BATCH_CASES) if batch else 1)
            entry = {"build_seconds": round(time.perf_counter() - t0, 1)}
            ref = Generator.from_bundle(reference)
            dev = Generator.from_bundle(bundle, backend="tensorrt")
            entry.update(compare_batch(ref, dev) if batch else
                         compare_generators(ref, dev, precision))
        except Exception as e:  # one engine's failure must not hide the others' results
            entry = {"status": "fail", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        report[label] = entry
        if entry["status"] == "fail":
            report["status"] = "fail"
    return report
