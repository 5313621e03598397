"""scripts/gpu_check.sh runs anywhere: without a GPU it reports every part as "not run" and
says why; with one, every part that ran must pass."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
PARTS = {"sampling_kernels", "device_kv", "ort_cuda", "tensorrt"}


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
