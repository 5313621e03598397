"""scripts/gpu_check.sh runs anywhere: without a GPU it reports every part as "not run" and
says why; with one, every part that ran must pass."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_sampling

    from specedge.runtime.backends.memory import HostMemory

    memory = HostMemory()
    sampler = sampler_class(memory)
    sampler.arch, sampler.close = "numpy", lambda: None
    return gpu_check_sampling.run(memory, sampler=sampler, greedy_cases=20, draws=3000,
                                  vocabs=(3000,))


def test_the_kernel_checks_pass_on_the_numpy_twin_and_catch_a_wrong_sampler():
    """scripts/gpu_check_sampling.py, the GPU part (a), run here against HostSampler (the
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
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    from specedge.runtime.backends.device_sampling import HostSampler
    from specedge.runtime.backends.memory import HostMemory

    report = gpu_check.check_device_loop(tiny_bundle, HostMemory, HostSampler)
    assert report["status"] == "pass", report
    assert report["identical_to_ort_cpu"] == report["greedy_cases"] == 8
