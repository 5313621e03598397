"""scripts/gpu_check.sh runs anywhere: without a GPU it reports every part as "not run" and
says why; with one, every part that ran must pass."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specedge.gpu_check import backends, comparison
from specedge.gpu_check import sampling as gpu_check_sampling
from specedge.gpu_check.backends import HostEngineOnDevice

ROOT = Path(__file__).parent.parent
PARTS = {"sampling_kernels", "device_kv", "device_loop", "ort_cuda", "tensorrt"}


def test_gpu_check_reports_what_it_could_run(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert set(report["parts"]) == PARTS
    if report["machine"]["gpu"] is None:
        assert proc.returncode == 0, proc.stderr
        assert report["status"] == "not run"
        for part in report["parts"].values():
            assert part["status"] == "not run" and part["reason"].startswith("no CUDA GPU")
        assert "no GPU on this machine" in proc.stderr
        assert report["parts"]["sampling_kernels"]["nvrtc_compile"].startswith("ok")
    else:
        assert proc.returncode == 0, proc.stderr
        assert report["status"] == "pass"


def _sampling_check(sampler_class):
    from specedge.runtime.backends.memory import HostMemory

    memory = HostMemory()
    sampler = sampler_class(memory)
    sampler.arch, sampler.close = "numpy", lambda: None
    return gpu_check_sampling.run(memory, sampler=sampler, greedy_cases=20, draws=3000,
                                  vocabs=(3000,))


def test_the_kernel_checks_pass_on_the_numpy_twin_and_catch_a_wrong_sampler():
    """specedge/gpu_check/sampling.py, the GPU part (a), run here against HostSampler (the
    kernels' interface in numpy): every section must pass; a sampler that accepts drafts
    without the u * q < p test must fail it. Sample sizes: 3000 draws per statistical
    section, alpha 0.001, seeded (the GPU run uses 20,000 and vocabularies 49152, 128256)."""
    from specedge.runtime.backends.device_sampling import HostSampler

    report = _sampling_check(HostSampler)
    assert report["status"] == "pass", report

    class AcceptsEverything(HostSampler):
        def verify_sampled(self, p_ptr, q_ptr, draft_ids, vocab, rng):
            rng.random(len(draft_ids) + 1)
            return len(draft_ids), int(draft_ids[0]) if draft_ids else 0

    broken = _sampling_check(AcceptsEverything)
    assert broken["status"] == "fail" and not broken["verify_sampled"]["passed"]


def test_the_device_loop_check_passes_on_host_memory(tiny_bundle):
    """gpu_check's device_loop part, with host memory and the numpy twin in place of the GPU
    and its kernels: the check's own plumbing (an engine reading device addresses through
    downloads and uploads) must reproduce ort-cpu; 600 generations per arm, alpha 0.001."""
    from specedge.runtime.backends.device_sampling import HostSampler
    from specedge.runtime.backends.memory import HostMemory

    report = backends.check_device_loop(tiny_bundle, HostMemory, HostSampler)
    assert report["status"] == "pass", report
    assert report["identical_to_ort_cpu"] == report["greedy_cases"] == 8
    assert report["batch"]["status"] == "pass" and report["batch"]["sequences"] == 4
    accepted, drafted = report["batch"]["accepted_of_drafted"]
    assert 0 < accepted < drafted


def test_the_batch_comparison_catches_a_row_that_lands_in_another_slot(tiny_bundle,
                                                                       monkeypatch):
    """compare_batch fails a device path whose calls on several slots write a row's new
    K/V rows into the wrong slot."""
    from specedge.runtime import Generator
    from specedge.runtime.backends.device_slots import DeviceSlotCaches

    write_rows = DeviceSlotCaches.write_rows

    def misplaced(self, slot, length, t, call_row=0, call_tokens=None):
        write_rows(self, slot, length, t, (call_row + 1) % 2 if call_tokens else call_row,
                   call_tokens)

    monkeypatch.setattr(DeviceSlotCaches, "write_rows", misplaced)
    report = comparison.compare_batch(Generator.from_bundle(tiny_bundle),
                                      Generator.from_bundle(tiny_bundle,
                                                            backend="host-emulated"))
    assert report["status"] == "fail" and report["first_divergence"]


def test_gpu_check_runs_this_checkout_without_an_install(tmp_path):
    """A GPU machine may hold the checkout and the dependencies but no installed specedge:
    the script must import this checkout's code. Stand-in for such a machine: a Python
    whose `import specedge` ignores site-packages (where the install lives)."""
    import sys

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.abc, importlib.machinery, sys\n"
        "class NotInstalled(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'specedge':\n"
        "            return None\n"
        "        spec = importlib.machinery.PathFinder.find_spec(\n"
        "            name, [p for p in sys.path if 'site-packages' not in p])\n"
        "        if spec is None:\n"
        "            raise ModuleNotFoundError('specedge is not installed', name=name)\n"
        "        return spec\n"
        "sys.meta_path.insert(0, NotInstalled())\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{hide}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    hidden = subprocess.run([str(python), "-c", "import specedge"], capture_output=True,
                            text=True, cwd=tmp_path)
    assert "specedge is not installed" in hidden.stderr  # the stand-in works
    out = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": str(python)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    if report["machine"]["gpu"] is None:
        assert report["parts"]["sampling_kernels"]["nvrtc_compile"].startswith("ok")
    else:
        assert report["status"] == "pass"


class _ScaledLogits(HostEngineOnDevice):
    """An engine whose logits come out 1.5 times too large: the same argmax everywhere, so
    the same greedy tokens, but every probability wrong."""

    def execute(self, key, plan, host_values):
        super().execute(key, plan, host_values)
        (logits,) = [b for b in plan if b.name == "logits"]
        rows = np.empty(logits.shape, logits.dtype)
        self.memory.download(logits.address, rows)
        self.memory.upload(logits.address, rows * np.float32(1.5))


def test_an_fp16_engine_is_judged_by_tolerance_not_token_equality(tiny_bundle,
                                                                   tiny_checkpoints,
                                                                   tmp_path):
    """gpu_check's comparison of an fp16 engine with ort-cpu, on the CPU: the tiny model's
    fp16 export through the host-emulated device path (what a TensorRT fp16 engine of it
    would compute, up to kernel choices), against ort-cpu on the fp32 graph. fp16 flips a
    near-tie, so token equality (the fp32 rule) fails a correct engine; the fp16 rule passes
    it and reports the agreement, the first divergence and the logit difference."""
    from specedge.export.bundle_writer import export_bundle
    from specedge.runtime import Generator
    from specedge.runtime.backends.device_sampling import HostSampler
    from specedge.runtime.backends.memory import HostMemory

    fp16 = tmp_path / "fp16"
    export_bundle(str(tiny_checkpoints["llama"]), fp16, draft_layers=1, precision="fp16")
    ref = Generator.from_bundle(tiny_bundle)
    report = comparison.compare_generators(
        ref, backends.device_generator(fp16, HostMemory, HostSampler), "fp16")
    assert report["status"] == "pass", report
    assert report["precision"] == "fp16" and report["tolerance"]["reason"]
    logits = report["teacher_forced_logits"]
    assert logits["positions"] == 2 * comparison.NEW_TOKENS
    assert 0.9 <= logits["greedy_agreement"] < 1.0
    assert set(logits["first_disagreement"]) == set(comparison.TINY_PROMPTS)
    assert [d for d in logits["first_disagreement"].values() if d is not None]
    assert 0 < logits["max_logit_diff_in_row_std"] <= 0.1
    assert report["identical_to_ort_cpu"] < report["greedy_cases"] == 8
    assert report["first_divergence"] == min(c["first_divergence"]
                                             for c in report["divergences"])
    for case in report["divergences"]:
        assert case["near_tie"] and 0 <= case["ort_cpu_margin_in_row_std"] <= 0.5
    # The same engine judged as fp32 (token for token, as gpu_check judged every engine):
    assert comparison.verdict("fp32", logits, report["divergences"])[0] == "fail"


def test_an_engine_with_wrong_logits_fails_though_its_tokens_are_right(tiny_bundle):
    """Control: logits 1.5 times too large keep every greedy token (8 cases of 8 equal to
    ort-cpu's) but are far outside any tolerance: fp32 and fp16 rules both fail it."""
    from specedge.runtime import Generator
    from specedge.runtime.backends.device_sampling import HostSampler
    from specedge.runtime.backends.memory import HostMemory

    dev = backends.device_generator(tiny_bundle, HostMemory, HostSampler, _ScaledLogits)
    report = comparison.compare_generators(Generator.from_bundle(tiny_bundle), dev, "fp16")
    assert report["identical_to_ort_cpu"] == report["greedy_cases"] == 8
    assert report["status"] == "fail"
    assert report["teacher_forced_logits"]["max_logit_diff_in_row_std"] > 0.25
    assert comparison.verdict("fp32", report["teacher_forced_logits"], [])[0] == "fail"


def test_the_verdict_allows_reduced_precision_divergences_only_at_near_ties():
    close = {"max_logit_diff_in_row_std": 0.1}

    def case(margin):
        return {"prompt": "p", "settings": {}, "first_divergence": 3,
                "ort_cpu_margin_in_row_std": margin, "near_tie": margin <= 0.5}

    assert comparison.verdict("fp16", close, [case(0.3)]) == ("pass", [])
    status, reasons = comparison.verdict("fp16", close, [case(0.3), case(0.8)])
    assert status == "fail" and len(reasons) == 1 and "not a near tie" in reasons[0]
    assert comparison.verdict("fp32", close, [])[0] == "fail"  # 0.1 > fp32's 1e-3
    assert comparison.verdict("fp32", {"max_logit_diff_in_row_std": 1e-6}, []) == ("pass", [])
    assert comparison.verdict("fp32", {"max_logit_diff_in_row_std": 1e-6},
                              [case(0.0)])[0] == "fail"
    assert comparison.verdict("bf16", {"max_logit_diff_in_row_std": 0.6}, [])[0] == "pass"
    assert comparison.verdict("fp16", {"max_logit_diff_in_row_std": 0.26}, [])[0] == "fail"
    with pytest.raises(ValueError, match="no logit tolerance is stated for precision 'int8'"):
        comparison.verdict("int8", close, [])


def test_logit_report_and_first_divergence():
    assert comparison.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert comparison.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert comparison.first_divergence([1, 2], [1, 2, 3]) == 2
    ref = np.array([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    dev = ref.copy()
    dev[1, 1] += 1.5  # 3.5: now above token 0's 3.0, so the argmax moves
    report = comparison.logit_report(ref, dev, [3, 0, 2])
    assert report["greedy_agreement"] == pytest.approx(2 / 3)
    assert report["first_disagreement"] == 1 and report["positions"] == 3
    assert report["max_logit_diff"] == 1.5
    assert report["max_logit_diff_in_row_std"] == pytest.approx(1.5 / ref[1].std())
    assert comparison.margin_in_row_std(ref[0], 3, 1) == pytest.approx(2 / ref[0].std())


def test_the_tensorrt_part_judges_each_engine_by_its_precision(tiny_bundle, tmp_path,
                                                                monkeypatch):
    """check_tensorrt's plumbing, TensorRT stood in for: `build_engines` records what it is
    asked to build, and backend 'tensorrt' is the host-emulated device backend on the
    bundle's own graph. The tiny fp32 engine must be judged token for token against the
    fp32 graph; the fp16 one, built from the fp16 export, by the fp16 tolerance against
    the fp32 graph (it leaves ort-cpu's tokens at a near tie, so token equality would fail
    it)."""
    import shutil

    import specedge.export.tensorrt.build as build
    from specedge.runtime import Generator

    built = []
    monkeypatch.setattr(build, "build_engines", lambda bundle, precision, max_batch: built.append(
        (Path(bundle).name, precision, max_batch)))
    from_bundle = Generator.from_bundle

    def emulated(bundle, backend="ort-cpu", **kwargs):
        return from_bundle(bundle, backend="host-emulated" if backend == "tensorrt"
                           else backend, **kwargs)

    monkeypatch.setattr(Generator, "from_bundle", staticmethod(emulated))
    shutil.copytree(tiny_bundle, tmp_path / "tiny-bundle")  # as --tiny-bundle gives it
    report = backends.check_tensorrt({"tensorrt": "10.3.0"}, tmp_path, None)
    assert built == [("tiny-trt", "fp32", 1), ("tiny-fp16-trt", "fp16", 1),
                     ("tiny-batch-trt", "fp32", 4)]
    assert report["status"] == "pass", report
    assert report["tiny-batch"]["status"] == "pass" and report["tiny-batch"]["sequences"] == 4
    assert report["tiny"]["precision"] == "fp32"
    assert report["tiny"]["identical_to_ort_cpu"] == 8
    assert report["tiny-fp16"]["precision"] == "fp16"
    assert report["tiny-fp16"]["identical_to_ort_cpu"] < 8
    assert report["smollm2"]["status"] == "not run"
