"""`specedge doctor`'s report: gathered once as a dict (what `--json` prints), drawn on one
screen from that dict."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specedge.doctor import software
from specedge.doctor.bundle_check import advise, check_bundle
from specedge.doctor.machine import read_machine
from specedge.runtime.bundle import load_bundle
from specedge.runtime.errors import BundleError


def gather(bundle: Path | None = None, threads: int | None = None) -> dict:
    """Everything the report says about this device (and `bundle` on it). A bundle that
    cannot be read is reported with its error (`bundle.error`), after the device."""
    loaded, error = None, None
    if bundle is not None:
        try:
            loaded = load_bundle(bundle)
        except BundleError as e:
            error = str(e)
    machine = read_machine()
    statuses = software.backend_statuses()
    runs = check_bundle(loaded, statuses, threads) if loaded is not None else None
    advice = advise(machine, statuses, runs, loaded)
    return {
        "machine": machine.as_dict(),
        "versions": software.versions(),
        "tensorrt": software.tensorrt_version(),
        "onnxruntime_providers": software.onnxruntime_providers(),
        "cuda": software.cuda_facts(),
        "backends": [asdict(s) for s in statuses],
        "bundle": None if bundle is None else {"path": str(bundle), "error": error,
                                               "backends": [asdict(r) for r in runs or []]},
        "advice": advice.as_dict(),
    }


def _mb(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 1024:.1f} GB"


def render(report: dict) -> str:
    """The report as lines of text, one screen."""
    m, v, cpu = report["machine"], report["versions"], report["machine"]["cpu"]
    lines = ["specedge doctor: what this device is and what runs on it", ""]
    lines.append(f"CPU      {cpu['model']} ({cpu['arch']}), {cpu['logical_cores']} cores: "
                 f"{cpu['physical_cores']} physical, {cpu['usable_cores']} usable")
    lines.append(f"         instruction sets: {' '.join(cpu['isa']) or 'none of note'}; "
                 f"int8 dot products: {', '.join(cpu['int8_dot']) or 'none'}")
    lines.append(f"Memory   {_mb(m['memory_total_mb'])}, {_mb(m['memory_available_mb'])} "
                 "available")
    lines.append(f"OS       {m['os']}, kernel {m['kernel']}")
    if m["jetson"]:
        j = m["jetson"]
        lines.append(f"Board    {j['board']}: L4T {j['l4t'] or 'unknown'}, JetPack "
                     f"{j['jetpack'] or 'unknown for this L4T release'}")
    elif m["board"]:
        lines.append(f"Board    {m['board']}")
    installed = [f"{name} {version}" for name, version in v.items()
                 if version and name not in ("python", "specedge")]
    lines.append(f"Python   {v['python']}; {', '.join(installed)}")
    lines.append(f"         onnxruntime providers: "
                 f"{', '.join(report['onnxruntime_providers']) or 'none'}")
    c = report["cuda"]
    if c["gpu"] or c["driver_cuda"]:
        lines.append(f"CUDA     GPU {c['gpu'] or 'none'}; driver CUDA {c['driver_cuda']}, "
                     f"cuda-python CUDA {c['runtime_cuda']}, NVRTC {c['nvrtc'] or 'missing'}"
                     f"; TensorRT {report['tensorrt'] or 'not installed'}")
    if c["why"]:
        lines.append(f"CUDA     {c['why']}")
    lines += ["", "Backends"]
    width = max(len(b["name"]) for b in report["backends"])
    for b in report["backends"]:
        lines.append(f"  {b['name']:<{width}}  {'runs' if b['runs'] else 'no  '}  {b['why']}")
    if report["bundle"]:
        lines += ["", f"Bundle {report['bundle']['path']}"]
        if report["bundle"]["error"]:
            lines.append(f"  cannot be read: {report['bundle']['error']}")
        for r in report["bundle"]["backends"]:
            if r["loads"]:
                step = "no step timed" if r["step_ms"] is None else \
                    f"one step {r['step_ms']:.1f} ms"
                lines.append(f"  {r['backend']:<{width}}  loads in {r['load_seconds']:.2f} s, "
                             f"{step}")
            else:
                lines.append(f"  {r['backend']:<{width}}  does not load: {r['why']}")
    a = report["advice"]
    lines += ["", f"Recommended: --backend {a['backend']} --threads {a['threads']}, "
              f"{a['precision']} weights"]
    lines += [f"  - {reason}" for reason in a["why"]]
    return "\n".join(lines)
