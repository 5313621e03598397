"""A bundle on this device: whether it loads on each backend that can run here, how long
loading takes and what one decoding step costs, and the settings to run it with.

A step is timed as plain decoding runs it (one target call of one token, no draft): the
mean target call of a generation of STEPS tokens after the first, the median of ROUNDS
such generations after a warm-up one, so that backends compare on the same work.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from specedge.doctor.machine import Machine
from specedge.doctor.software import BackendStatus
from specedge.runtime import Generator
from specedge.runtime.bundle import Bundle
from specedge.runtime.errors import BackendUnavailableError, BundleError

STEPS = 8
ROUNDS = 3
PROMPT = "The device on the desk answers questions about"
# A GPU backend first where it runs: the host-emulated one is the GPU code on the CPU, for
# tests only, and never the one to run.
PREFERENCE = ("tensorrt", "ort-cuda", "ort-cpu")


@dataclass(frozen=True)
class BundleRun:
    backend: str
    loads: bool
    why: str | None = None           # why it did not load, and what to do
    load_seconds: float | None = None
    step_ms: float | None = None     # one plain decoding step (module docstring)


def try_backend(bundle: Bundle, backend: str, threads: int | None) -> BundleRun:
    """Load `bundle` on `backend` and time its load and a plain step."""
    start = time.perf_counter()
    try:
        gen = Generator.from_bundle(bundle, backend=backend, threads=threads)
    except (BackendUnavailableError, BundleError) as e:
        return BundleRun(backend, False, str(e))
    loaded = time.perf_counter() - start
    ids = gen.encode_prompt(PROMPT, raw=True)
    steps = []
    for _ in range(ROUNDS + 1):  # the first warms up
        stats = gen.generate(prompt_ids=ids, max_new_tokens=STEPS + 1, use_draft=False).stats
        if stats["target_calls"]:  # none when the first token ends the generation
            steps.append(stats["time_target_s"] / stats["target_calls"] * 1e3)
    step = statistics.median(steps[1:]) if len(steps) > 1 else None
    return BundleRun(backend, True, None, loaded, step)


def check_bundle(bundle: Bundle, statuses: list[BackendStatus],
                 threads: int | None) -> list[BundleRun]:
    """Every backend that runs here, tried with `bundle`; the others with their reason."""
    return [try_backend(bundle, s.name, threads) if s.runs else BundleRun(s.name, False, s.why)
            for s in statuses]


@dataclass(frozen=True)
class Advice:
    backend: str
    threads: int
    precision: str
    why: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def advise(machine: Machine, statuses: list[BackendStatus], runs: list[BundleRun] | None,
           bundle: Bundle | None) -> Advice:
    """The backend, threads and precision to run with here, each with its reason."""
    why = []
    usable = {s.name for s in statuses if s.runs}
    timed = sorted((r.step_ms, r.backend) for r in runs or ()
                   if r.loads and r.backend in PREFERENCE and r.step_ms is not None)
    if timed:
        backend = timed[0][1]
        why.append(f"backend {backend}: the fastest step of this bundle here "
                   f"({timed[0][0]:.1f} ms)")
    else:
        backend = next((b for b in PREFERENCE if b in usable), "ort-cpu")
        why.append(f"backend {backend}: " + ("a GPU backend runs here" if backend != "ort-cpu"
                                            else "no GPU backend runs here"))
    cpu = machine.cpu
    threads = max(1, min(cpu.physical_cores, cpu.usable_cores))
    why.append(f"threads {threads}: one a physical core this process may use "
               f"({cpu.physical_cores} physical, {cpu.usable_cores} usable)")
    if backend == "tensorrt":
        precision = "fp16"
        why.append("precision fp16: engines at fp16 (TensorRT 10: specedge build --precision "
                   "fp16; TensorRT 11: a bundle exported with --attention portable "
                   "--precision fp16, then specedge build; docs/gpu.md#installing)")
    elif backend == "ort-cuda":
        precision = "fp16"
        why.append("precision fp16: half the bytes a token of fp32 on the GPU (specedge export "
                   "... --attention portable --precision fp16)")
    else:
        precision = "int4"
        dots = ", ".join(cpu.int8_dot) or "none: ONNX Runtime dequantizes to float"
        why.append(f"precision int4: the fewest bytes a token on the CPU (int8 dot products: "
                   f"{dots}); specedge export ... --precision int4")
        batched = bundle is not None and \
            bundle.manifest["models"]["target"].get("attention") == "batched"
        if cpu.arch == "aarch64" and not batched:
            # ONNX Runtime's aarch64 GroupQueryAttention computes a row of a many-row call
            # apart from a two-row call, which int8 activations grow to a logit; batched
            # attention keeps them equal (docs/design.md#on-aarch64).
            why.append("on aarch64 greedy speculative output can part from plain decoding at a "
                       "near tie with int8/int4 weights on fused attention: export with "
                       "--attention batched where it must not")
    if bundle is not None:
        have = bundle.manifest.get("precision")
        if have and have != precision and backend in ("ort-cpu", "ort-cuda"):
            why.append(f"this bundle is {have}: re-export it with --precision {precision}")
        elif have == precision:
            why.append(f"this bundle is {have} already")
    return Advice(backend, threads, precision, why)
