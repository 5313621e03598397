"""The GPU path end to end, in one short run on a CUDA machine; writes a JSON report.

    python scripts/gpu_check.py --out gpu_report.json     (scripts/gpu_check.sh wraps it)

Where the GPU machine cannot export (no torch, or another transformers), export the tiny
bundles first and take them along:
    python scripts/gpu_check.py --prepare .gpu              # here: .gpu/tiny-bundle{,-fp16}
    bash scripts/gpu_check.sh report.json --tiny-bundle .gpu/tiny-bundle   # there

Parts, each "pass", "fail" or "not run" with the reason:
  sampling_kernels  NVRTC-compiled sampling / verification kernels vs the numpy reference
                    (exact for greedy, chi-square for sampling), vocabularies 49152, 128256
  device_kv         cuda-python device KV buffers: in-place strided row writes and rollback
                    vs the host KVCache, bit for bit
  device_loop       the tiny bundle through the device backend on the GPU (arena, row copies,
                    kernels choosing tokens next to the logits) with ONNX Runtime CPU as
                    the engine, vs 'ort-cpu': fp32, so greedy tokens equal; sampled
                    distribution by a two-sample test
  ort_cuda          the tiny bundle on backend 'ort-cuda' vs 'ort-cpu' (onnxruntime-gpu); TF32
                    on compute capability 8.0 and newer, so judged as a reduced precision
  tensorrt          engines built for the tiny bundle (fp32, and fp16 from its fp16 export)
                    and SmolLM2 (fp16), greedy generation and logits vs 'ort-cpu' (needs
                    TensorRT)
On a machine without a GPU every part says so and the exit status is 0; it is 1 when a part
that ran failed.

How an engine is compared with 'ort-cpu' (`compare_generators`): 2 prompts x 4 greedy
settings (plain, model draft, lookup then model, prompt lookup) of 32 tokens each
give the first divergence of each case; ort-cpu's plain tokens, fed to both target graphs
one at a time, give per-position logits: the greedy agreement rate, the first disagreement,
and the largest |logit difference|, also in units of the standard deviation of ort-cpu's
logits in that row (logits have no common scale across models: a bound in logits would be
loose for one model and tight for another). The verdict:
  fp32 (same arithmetic, another summation order): every case's tokens identical to
      ort-cpu's, and logits within 1e-3 row std (fp32 kernels differ by ~1e-6 of it).
  fp16, tf32 (10-bit mantissa) and bf16 (7-bit): fp16 rounds near-ties the other way, so
      equal tokens are not expected. Pass when the logits are within the tolerance (fp16,
      tf32: 0.25 row std; bf16: 1.0) and every case leaves ort-cpu's tokens only at a near
      tie: a position where ort-cpu's logit for its own token exceeds its logit for the
      engine's by at most twice the tolerance (each of the two may move by the tolerance).
      Why 0.25: SmolLM2-135M in fp16 (fp32 accumulation) is within 0.05 row std of fp32 on
      94 positions, the tiny bundle's fp16 graph within 0.02; a lost KV row moves SmolLM2's
      logits by 6.8 row std. bf16's rounding unit is 8x fp16's: ~0.4 expected, 1.0 allowed.
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

# This checkout's code first, installed or not (a GPU machine may only have the checkout);
# then this folder, for gpu_check_sampling.
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))

TINY_PROMPTS = ["hello world", "the cat sat on the mat"]
GREEDY_SETTINGS = (dict(use_draft=False), dict(draft_tokens=3, drafter="model"),
                   dict(draft_tokens=3, drafter="lookup+model"),
                   dict(draft_tokens=2, drafter="prompt-lookup"))
NEW_TOKENS = 32
ALPHA = 1e-3
# Largest |logit difference| from ort-cpu, in units of the standard deviation of ort-cpu's
# logits in that row, per engine precision; the reasons are in the docstring.
LOGIT_TOLERANCES = {"fp32": 1e-3, "tf32": 0.25, "fp16": 0.25, "bf16": 1.0}
TOLERANCE_REASON = (
    "largest |logit - ort-cpu logit| over the row's standard deviation of ort-cpu logits. "
    "fp32: the same arithmetic in another order (~1e-6), so greedy tokens must be identical. "
    "fp16 / tf32 (10-bit mantissa): 0.25, 5x what fp16 does to SmolLM2-135M (0.05; a lost KV "
    "row: 6.8); bf16 (rounding unit 8x fp16's): 1.0. Reduced precisions flip near-ties, so "
    "their tokens may leave ort-cpu's where ort-cpu's margin between the two tokens is at "
    "most twice the tolerance.")


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


def tiny_bundle(root: Path, precision: str = "fp32") -> Path:
    """The tests' tiny Llama exported into `root` at `precision` (torch + transformers
    needed), once: root/tiny-bundle, or root/tiny-bundle-fp16."""
    out = root / ("tiny-bundle" if precision == "fp32" else f"tiny-bundle-{precision}")
    if (out / "manifest.json").is_file():
        return out
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from tiny_models import save_tiny

    from specedge.export.bundle_writer import export_bundle

    checkpoint = root / "tiny-llama"
    if not (checkpoint / "config.json").is_file():
        checkpoint = save_tiny(checkpoint, "llama")
    export_bundle(str(checkpoint), out, draft_layers=1, precision=precision)
    return out


def logit_tolerance(precision: str) -> float:
    if precision not in LOGIT_TOLERANCES:
        raise ValueError(f"no logit tolerance is stated for precision {precision!r}; "
                         f"gpu_check compares {', '.join(LOGIT_TOLERANCES)} engines")
    return LOGIT_TOLERANCES[precision]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (where the shorter one ends, if it
    is a prefix of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_report(ref_rows: np.ndarray, dev_rows: np.ndarray, tokens: list[int]) -> dict:
    """How far an engine's logits [N, V] are from ort-cpu's at the same N positions, where
    `tokens` are ort-cpu's greedy tokens (the argmax of each of its rows)."""
    ref_rows, dev_rows = np.asarray(ref_rows, np.float64), np.asarray(dev_rows, np.float64)
    diff = np.abs(dev_rows - ref_rows)
    agree = dev_rows.argmax(axis=1) == np.asarray(tokens)
    return {"positions": len(tokens), "greedy_agreement": float(agree.mean()),
            "first_disagreement": None if agree.all() else int(np.argmin(agree)),
            "max_logit_diff": float(diff.max()),
            "max_logit_diff_in_row_std": float((diff.max(axis=1) / ref_rows.std(axis=1)).max())}


def margin_in_row_std(row: np.ndarray, token: int, other: int) -> float:
    """How much `row` prefers `token` to `other`, in units of the row's standard deviation."""
    row = np.asarray(row, np.float64)
    return float((row[token] - row[other]) / row.std())


def verdict(precision: str, logits: dict, divergences: list[dict]) -> tuple[str, list[str]]:
    """("pass" or "fail", the reasons for a fail) of one engine against ort-cpu: logits
    within the precision's tolerance and, in fp32, no case leaving ort-cpu's tokens; in a
    reduced precision, cases leaving them only at a near tie (`near_tie`)."""
    tolerance, reasons = logit_tolerance(precision), []
    if not logits["max_logit_diff_in_row_std"] <= tolerance:
        reasons.append(f"logits {logits['max_logit_diff_in_row_std']:.3g} row std from "
                       f"ort-cpu's, more than the {precision} tolerance {tolerance}")
    for case in divergences:
        if precision == "fp32" or not case["near_tie"]:
            reasons.append(f"{case['prompt']!r} {case['settings']}: tokens leave ort-cpu's at "
                           f"position {case['first_divergence']}"
                           + ("" if precision == "fp32" else
                              f", where ort-cpu prefers its token by "
                              f"{case['ort_cpu_margin_in_row_std']} row std (more than "
                              f"twice the tolerance: not a near tie)"))
    return ("fail" if reasons else "pass"), reasons


def _cache(backend, tokens: int):
    from specedge.runtime.kv_cache import capacity_for

    return backend.new_cache(capacity_for(tokens, backend.spec.max_context))


def _close(cache) -> None:
    close = getattr(cache, "close", None)  # device caches hold device memory
    if close is not None:
        close()


def teacher_forced_rows(backend, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """The backend's logits [len(tokens), V] for each of `tokens` after `prompt_ids`: the
    prompt in one call, then `tokens` one at a time (row i predicts tokens[i])."""
    cache = _cache(backend, len(prompt_ids) + len(tokens))
    rows = [np.array(backend.forward(cache, prompt_ids, 1)[-1], np.float64)]
    rows += [np.array(backend.forward(cache, [t], 1)[-1], np.float64) for t in tokens[:-1]]
    _close(cache)
    return np.stack(rows)


def _row_after(backend, ids: list[int]) -> np.ndarray:
    cache = _cache(backend, len(ids))
    row = np.array(backend.forward(cache, ids, 1)[-1], np.float64)
    _close(cache)
    return row


def compare_generators(ref, dev, precision: str = "fp32", sampled_draws: int = 0) -> dict:
    """An engine (`dev`, a Generator) against ort-cpu (`ref`) at an engine `precision`, as
    the module docstring says. With `sampled_draws`, the first two sampled tokens must also
    follow the same distribution (two-sample chi-square, that many generations per arm,
    seeds 0.. and 10000.., alpha ALPHA)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from two_sample import first_two_tokens, two_sample_test

    tolerance = logit_tolerance(precision)
    cases, equal, speeds, divergences, rows = 0, 0, [], [], ([], [], [])
    for prompt in TINY_PROMPTS:
        prompt_ids, plain = ref.codec.encode(prompt), None
        for settings in GREEDY_SETTINGS:
            a = ref.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, **settings)
            b = dev.generate(prompt, raw=True, max_new_tokens=NEW_TOKENS, **settings)
            if settings is GREEDY_SETTINGS[0]:  # plain decoding: the path both are fed
                plain = a.token_ids
            cases += 1
            speeds.append(b.stats.get("tokens_per_second"))
            d = first_divergence(a.token_ids, b.token_ids)
            if d is None:
                equal += 1
                continue
            case = {"prompt": prompt, "settings": settings, "first_divergence": d,
                    "ort_cpu_margin_in_row_std": None, "near_tie": False}
            if d < min(len(a.token_ids), len(b.token_ids)):
                row = _row_after(ref.target, prompt_ids + a.token_ids[:d])
                margin = margin_in_row_std(row, a.token_ids[d], b.token_ids[d])
                case.update(ort_cpu_margin_in_row_std=round(margin, 4),
                            near_tie=margin <= 2 * tolerance)
            divergences.append(case)
        rows[0].append(teacher_forced_rows(ref.target, prompt_ids, plain))
        rows[1].append(teacher_forced_rows(dev.target, prompt_ids, plain))
        rows[2].append(plain)
    logits = logit_report(np.concatenate(rows[0]), np.concatenate(rows[1]),
                          sum(rows[2], []))
    logits["first_disagreement"] = {  # per prompt: a position in its continuation
        prompt: logit_report(r, d, t)["first_disagreement"]
        for prompt, r, d, t in zip(TINY_PROMPTS, *rows)}
    status, reasons = verdict(precision, logits, divergences)
    report = {"status": status, "precision": precision,
              "rule": ("greedy tokens identical to ort-cpu's" if precision == "fp32" else
                       "greedy tokens may leave ort-cpu's only at near ties") +
                      f"; logits within {tolerance} row std",
              "tolerance": {"max_logit_diff_in_row_std": tolerance,
                            "near_tie_margin_in_row_std": 2 * tolerance,
                            "reason": TOLERANCE_REASON},
              "greedy_cases": cases, "identical_to_ort_cpu": equal,
              "first_divergence": min((c["first_divergence"] for c in divergences),
                                      default=None),
              "divergences": divergences, "teacher_forced_logits": logits,
              "tokens_per_second": speeds}
    if reasons:
        report["failures"] = reasons
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

    return compare_generators(Generator.from_bundle(bundle),
                              device_generator(bundle, memory_class, sampler_class),
                              "fp32", sampled_draws=600)


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
    for label, bundle, precision, reference in targets:
        t0 = time.perf_counter()
        try:
            build_engines(bundle, precision=precision)
            entry = {"build_seconds": round(time.perf_counter() - t0, 1)}
            entry.update(compare_generators(Generator.from_bundle(reference),
                                            Generator.from_bundle(bundle, backend="tensorrt"),
                                            precision))
        except Exception as e:  # one engine's failure must not hide the others' results
            entry = {"status": "fail", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        report[label] = entry
        if entry["status"] == "fail":
            report["status"] = "fail"
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
    parser.add_argument("--tiny-bundle", help="FOLDER/tiny-bundle exported beforehand, with "
                        "FOLDER/tiny-bundle-fp16 next to it (where this machine cannot "
                        "export: no torch or transformers)")
    parser.add_argument("--prepare", metavar="FOLDER", help="only export the tiny bundles "
                        "into FOLDER/tiny-bundle and FOLDER/tiny-bundle-fp16 (on a machine "
                        "with torch), to carry to the GPU")
    args = parser.parse_args()
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
