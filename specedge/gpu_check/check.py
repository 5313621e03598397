"""The GPU path end to end, in one short run on a CUDA machine; writes a JSON report.

    specedge gpu-check --out gpu_report.json     (scripts/gpu_check.sh wraps it)

Where the GPU machine cannot export (no torch, or another transformers), export the tiny
bundles first and take them along:
    specedge gpu-check --prepare .gpu             # here: .gpu/tiny-bundle{,-fp16}
    bash scripts/gpu_check.sh report.json --tiny-bundle .gpu/tiny-bundle   # there

Parts, each "pass", "fail" or "not run" with the reason:
  sampling_kernels  NVRTC-compiled sampling / verification kernels vs the numpy reference
                    (exact for greedy, chi-square for sampling), vocabularies 49152, 128256
                    (sampling.py)
  device_kv         cuda-python device KV buffers: in-place strided row writes and rollback
                    vs the host KVCache, bit for bit
  device_loop       the tiny bundle through the device backend on the GPU (arena, row copies,
                    kernels choosing tokens next to the logits) with ONNX Runtime CPU as
                    the engine, vs 'ort-cpu': fp32, so greedy tokens equal; sampled
                    distribution by a two-sample test; and four sequences decoded together
                    (the slots' arena on the GPU), each equal to its plain decoding alone
  ort_cuda          the tiny bundle on backend 'ort-cuda' vs 'ort-cpu' (onnxruntime-gpu),
                    judged as fp32: its sessions ask for use_tf32=0
  tensorrt          engines built for the tiny bundle (fp32, and fp16 from its fp16 export)
                    and SmolLM2 (fp16), greedy generation and logits vs 'ort-cpu'; fp32
                    engines built for four sequences a call (--max-batch 4), those
                    sequences decoded together, each equal to its plain decoding alone
                    (needs TensorRT)
(the last four: backends.py; how an engine is judged against 'ort-cpu':
comparison.py). On a machine without a GPU every part says so and the exit status
is 0; it is 1 when a part that ran failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from specedge.gpu_check.backends import (
    check_device_kv,
    check_device_loop,
    check_ort_cuda,
    check_tensorrt,
    tiny_bundle,
)


def machine() -> dict:
    """What the report records of the machine: Python, numpy, the GPU, its driver, NVRTC,
    TensorRT and ONNX Runtime versions and providers."""
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
        from specedge.runtime.backends.sampling_kernels import compile_sampling_kernels

        return f"ok: {len(compile_sampling_kernels())} bytes of compute_90 PTX"
    except Exception as e:  # reported, not raised: the report is the product here
        return f"failed: {type(e).__name__}: {e}"


def run_part(name: str, fn, report: dict) -> None:
    """report[name] = fn(), or what broke, with its duration; one line on stderr."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The check's flags, on `parser`."""
    parser.add_argument("--out", default="gpu_report.json",
                        help="JSON report to write (default gpu_report.json)")
    parser.add_argument("--smollm2-bundle", help="an exported SmolLM2 bundle for the "
                        "TensorRT part")
    parser.add_argument("--tiny-bundle", help="FOLDER/tiny-bundle exported beforehand, with "
                        "FOLDER/tiny-bundle-fp16 next to it (where this machine cannot "
                        "export: no torch or transformers)")
    parser.add_argument("--prepare", metavar="FOLDER", help="only export the tiny bundles "
                        "into FOLDER/tiny-bundle and FOLDER/tiny-bundle-fp16 (on a machine "
                        "with torch), to carry to the GPU")


def run(args: argparse.Namespace) -> int:
    """Run the check as `args` say (or only prepare the tiny bundles); returns the exit
    status: 1 when a part that ran failed, else 0."""
    if args.prepare:
        for precision in ("fp32", "fp16"):
            print(tiny_bundle(Path(args.prepare), precision))
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
        from specedge.gpu_check.sampling import run as check_sampling
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


def main(argv: list[str] | None = None) -> int:
    """`python -m specedge.gpu_check [flags]`, the same as `specedge gpu-check [flags]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
