"""The GPU path end to end, in one short run on a CUDA machine; writes a JSON report.

    python scripts/gpu_check.py --out gpu_report.json     (scripts/gpu_check.sh wraps it)

Where the GPU machine cannot export (no torch, or another transformers), export the tiny
bundle first and take it along:
    python scripts/gpu_check.py --prepare .gpu              # here: .gpu/tiny-bundle
    bash scripts/gpu_check.sh report.json --tiny-bundle .gpu/tiny-bundle   # there

Parts, each "pass", "fail" or "not run" with the reason:
  sampling_kernels  NVRTC-compiled sampling / verification kernels vs the numpy reference
                    (exact for greedy, chi-square for sampling), vocabularies 49152, 128256
  device_kv         cuda-python device KV buffers: in-place strided row writes and rollback
                    vs the host KVCache, bit for bit
  device_loop       the tiny bundle through the device backend on the GPU (arena, row copies,
                    kernels choosing tokens next to the logits) with ONNX Runtime CPU as
                    the engine, vs 'ort-cpu': greedy tokens equal, sampled distribution
  ort_cuda          the tiny bundle on backend 'ort-cuda' vs 'ort-cpu' (onnxruntime-gpu)
  tensorrt          engines built for the tiny bundle and SmolLM2, parity and speculative
                    decoding vs 'ort-cpu' (needs TensorRT)
On a machine without a GPU every part says so and the exit status is 0; it is 1 when a part
that ran failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

TINY_PROMPTS = ["hello world", "the cat sat on the mat"]
ALPHA = 1e-3


def machine() -> dict:
    info: dict = {"python": platform.python_version(), "numpy": np.__version__, "gpu": None}
    try:
        from cuda.bindings import nvrtc
        from cuda.bindings import runtime as cudart

        info["nvrtc_version"] = list(nvrtc.nvrtcVersion()[1:])
        err, count = cudart.cudaGetDeviceCount()
        info["cuda_devices"] = count if int(err) == 0 else 0
        if int(err) != 0:
            info["cuda_error"] = repr(err)
        else:
            from specedge.runtime.backends.engine_manifest import gpu_identity

            name, capability = gpu_identity()
            info["gpu"] = {"name": name, "compute_capability": list(capability)}
            info["driver_version"] = cudart.cudaDriverGetVersion()[1]
    except ImportError as e:
        info["cuda_python"] = f"not importable: {e}"
    for module in ("tensorrt", "onnxruntime"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    if info["onnxruntime"]:
        import onnxruntime

        info["onnxruntime_providers"] = onnxruntime.get_available_providers()
    return info


def compile_only() -> str:
    """Without a GPU the kernels can still be compiled (NVRTC needs no device)."""
    try:
        from specedge.runtime.backends.device_sampling import compile_sampling_kernels

        return f"ok: {len(compile_sampling_kernels())} bytes of compute_90 PTX"
    except Exception as e:  # reported, not raised: the report is the product here
        return f"failed: {type(e).__name__}: {e}"


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


def tiny_bundle(root: Path) -> Path:
    """The tests' tiny Llama exported into `root` (torch + transformers needed), once."""
    out = root / "tiny-bundle"
    if (out / "manifest.json").is_file():
        return out
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from tiny_models import save_tiny

    from specedge.export.bundle_writer import export_bundle

    checkpoint = save_tiny(root / "tiny-llama", "llama")
    export_bundle(str(checkpoint), out, draft_layers=1)
    return out


def compare_generators(ref, dev, sampled_draws: int = 0) -> dict:
    """Greedy plain and speculative generations must be token for token the same; with
    `sampled_draws`, the first two sampled tokens must follow the same distribution
    (two-sample chi-square, that many generations per arm, alpha ALPHA, seeded)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from two_sample import first_two_tokens, two_sample_test

    cases, equal, speeds = 0, 0, []
    for prompt in TINY_PROMPTS:
        for kwargs in (dict(use_draft=False), dict(draft_tokens=3, drafter="model"),
                       dict(draft_tokens=3), dict(draft_tokens=2, drafter="prompt-lookup")):
            a = ref.generate(prompt, raw=True, max_new_tokens=32, **kwargs)
            b = dev.generate(prompt, raw=True, max_new_tokens=32, **kwargs)
            cases += 1
            equal += a.token_ids == b.token_ids
            speeds.append(b.stats.get("tokens_per_second"))
    report = {"status": "pass" if equal == cases else "fail", "greedy_cases": cases,
              "identical_to_ort_cpu": equal, "tokens_per_second": speeds}
    if sampled_draws:
        kwargs = dict(draft_tokens=3, temperature=0.8, top_p=0.9, drafter="model")
        stat, pvalue, _ = two_sample_test(first_two_tokens(ref, sampled_draws, 0, **kwargs),
                                          first_two_tokens(dev, sampled_draws, 10_000,
                                                           **kwargs))
        report["sampled_first_two_tokens"] = {"draws_per_arm": sampled_draws, "alpha": ALPHA,
                                              "statistic": stat, "pvalue": pvalue}
        if not pvalue > ALPHA:
            report["status"] = "fail"
    return report


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


def check_device_loop(bundle: Path, memory_class, sampler_class) -> dict:
    """The whole device path but the engine: DeviceBackend on `memory_class` memory with the
    kernels (`sampler_class`) choosing tokens next to the logits, vs ort-cpu."""
    from specedge.runtime import Generator
    from specedge.runtime.backends.device import DeviceBackend
    from specedge.runtime.bundle import load_bundle
    from specedge.runtime.text import TextCodec

    b = load_bundle(bundle)
    backends = []
    for role in ("target", "draft"):
        spec, memory = getattr(b, role), memory_class()
        backends.append(DeviceBackend("device-loop", spec, HostEngineOnDevice(spec, memory),
                                      memory, sampler_class(memory)))
    dev = Generator(b, *backends, TextCodec(b))
    return compare_generators(Generator.from_bundle(bundle), dev, sampled_draws=600)


def check_ort_cuda(info: dict, work: Path) -> dict:
    if "CUDAExecutionProvider" not in (info.get("onnxruntime_providers") or []):
        return {"status": "not run", "reason": "onnxruntime-gpu (CUDAExecutionProvider) is "
                "not installed"}
    from specedge.runtime import Generator

    bundle = tiny_bundle(work)
    return compare_generators(Generator.from_bundle(bundle),
                              Generator.from_bundle(bundle, backend="ort-cuda"))


def check_tensorrt(info: dict, work: Path, smollm2: str | None) -> dict:
    if info["tensorrt"] is None:
        return {"status": "not run", "reason": "TensorRT is not importable on this machine"}
    from specedge.export.tensorrt.build import build_engines
    from specedge.runtime import Generator

    bundles = {"tiny": tiny_bundle(work)}  # built on a copy: engines are written into it
    shutil.copytree(bundles["tiny"], work / "tiny-trt", dirs_exist_ok=True)
    bundles["tiny"] = work / "tiny-trt"
    if smollm2:
        bundles["smollm2"] = Path(smollm2)
    report: dict = {"status": "pass"}
    for label, bundle in bundles.items():
        t0 = time.perf_counter()
        build_engines(bundle, precision="fp32" if label == "tiny" else "fp16")
        entry = {"build_seconds": round(time.perf_counter() - t0, 1)}
        entry.update(compare_generators(Generator.from_bundle(bundle),
                                        Generator.from_bundle(bundle, backend="tensorrt")))
        report[label] = entry
        if entry["status"] != "pass":
            report["status"] = "fail"
    if not smollm2:
        report["smollm2"] = {"status": "not run", "reason": "pass --smollm2-bundle DIR"}
    return report


def run_part(name: str, fn, report: dict) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # a report of what broke beats a traceback with no report
        report[name] = {"status": "fail", "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(limit=8)}
    report[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {report[name]['status']}"
          + (f" ({report[name]['reason']})" if "reason" in report[name] else ""),
          file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_report.json", help="JSON report to write")
    parser.add_argument("--smollm2-bundle", help="an exported SmolLM2 bundle for the "
                        "TensorRT part")
    parser.add_argument("--tiny-bundle", help="FOLDER/tiny-bundle exported beforehand (where "
                        "this machine cannot export: no torch or transformers)")
    parser.add_argument("--prepare", metavar="FOLDER", help="only export the tiny bundle into "
                        "FOLDER/tiny-bundle (on a machine with torch), to carry to the GPU")
    args = parser.parse_args()
    if args.prepare:
        print(tiny_bundle(Path(args.prepare)))
        return 0
    started = time.perf_counter()
    info = machine()
    report: dict = {"machine": info, "parts": {}}
    parts = report["parts"]
    if not info["gpu"]:
        reason = ("no CUDA GPU: " + info.get("cuda_error", info.get("cuda_python", "none "
                  "found")))
        for name in ("sampling_kernels", "device_kv", "device_loop", "ort_cuda", "tensorrt"):
            parts[name] = {"status": "not run", "reason": reason}
        parts["sampling_kernels"]["nvrtc_compile"] = compile_only()
        print(f"no GPU on this machine; every part: not run ({reason})", file=sys.stderr)
    else:
        from gpu_check_sampling import run as check_sampling

        from specedge.runtime.backends.device_sampling import DeviceSampler
        from specedge.runtime.backends.memory import CudaMemory

        memory = CudaMemory()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(args.tiny_bundle).parent if args.tiny_bundle else Path(tmp)
            run_part("sampling_kernels", lambda: check_sampling(memory), parts)
            run_part("device_kv", lambda: check_device_kv(memory), parts)
            run_part("device_loop", lambda: check_device_loop(
                tiny_bundle(work), CudaMemory, DeviceSampler), parts)
            run_part("ort_cuda", lambda: check_ort_cuda(info, work), parts)
            run_part("tensorrt", lambda: check_tensorrt(info, work, args.smollm2_bundle),
                     parts)
    report["seconds"] = round(time.perf_counter() - started, 1)
    failed = [n for n, p in parts.items() if p["status"] == "fail"]
    ran = [n for n, p in parts.items() if p["status"] != "not run"]
    report["status"] = "fail" if failed else "pass" if ran else "not run"
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"report: {args.out} ({'failed: ' + ', '.join(failed) if failed else 'no failures'})",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
