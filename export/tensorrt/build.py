"""`specedge build`: turn a bundle's ONNX graphs into TensorRT engines, in place, on the device.

An engine is tied to its GPU model and TensorRT version, so this runs where the model will
run, and it is torch-free: it imports only the standard library, specedge.runtime and (lazily)
tensorrt and cuda-python. The steps:

1. plan (tensorrt/plan.py, pure, tested without a GPU): validate the arguments and the
   bundle, compute the optimization profiles (runtime/backends/engine_manifest.py) and
   the builder flags;
2. check the machine: tensorrt importable and a supported version (10.x or 11.x), a GPU
   whose compute capability has the precision, and, on TensorRT 11, which takes precision
   from the graph's types, a graph in the precision asked;
3. build (tensorrt/engine_calls.py, the only code that calls TensorRT) each engine that is not
   up to date into a temporary file;
4. move the engines into place and rewrite manifest.json with its `engines` entry, each
   atomically (runtime/atomic_files.py), keeping everything else in the manifest.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import ModuleType

from specedge.export.tensorrt.plan import (
    DEFAULT_MAX_DRAFT_TOKENS,
    TIMING_CACHE,
    check_graph_precision,
    check_precision,
    check_precision_supported,
    is_up_to_date,
    plan_builds,
)
from specedge.runtime.atomic_files import atomic_write, temp_path
from specedge.runtime.backends.engine_manifest import engine_record, gpu_identity, tensorrt_major
from specedge.runtime.backends.engines import import_tensorrt
from specedge.runtime.bundle import MANIFEST, load_bundle


def preflight(precision: str = "fp16") -> tuple[ModuleType, tuple[str, tuple[int, int]]]:
    """Everything about the machine a build needs, checked in seconds: (tensorrt, gpu).

    BackendUnavailableError for a TensorRT other than 10.x / 11.x: their Python APIs are the
    ones tensorrt/engine_calls.py is written for.
    """
    check_precision(precision)
    trt = import_tensorrt()
    tensorrt_major(getattr(trt, "__version__", "of unknown version"))
    gpu = gpu_identity()
    check_precision_supported(precision, gpu)
    return trt, gpu


def write_engines_entry(root: Path, engines: dict) -> dict:
    """Set manifest["engines"], keeping everything else; returns the new manifest."""
    path = root / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["engines"] = engines
    atomic_write(path, json.dumps(manifest, indent=2).encode())
    return manifest


def build_engines(bundle_dir: str | Path, precision: str = "fp16",
                  max_prompt: int | None = None,
                  max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                  max_context: int | None = None, timing_cache: str | Path | None = None,
                  force: bool = False, max_batch: int = 1) -> dict:
    """Build `target.engine` (and `draft.engine`) in the bundle; returns the new manifest.

    `max_prompt` defaults to min(2048, context); `max_batch` is the most sequences a call
    carries (`specedge serve --max-batch`; 1: one at a time). Engines already built with the same
    arguments, from the same graphs, on this GPU and TensorRT version are kept unless
    `force`. The timing cache (default <bundle>/timing.cache) is reused and updated.
    """
    bundle = load_bundle(bundle_dir)
    plans = plan_builds(bundle, precision, max_prompt, max_draft_tokens, max_context,
                        max_batch)
    cache = Path(timing_cache) if timing_cache is not None else bundle.root / TIMING_CACHE
    if cache.is_dir() or not cache.parent.is_dir():
        raise ValueError(f"--timing-cache {cache}: give a file in an existing folder")
    trt, gpu = preflight(precision)
    from specedge.export.tensorrt import engine_calls  # the only module that calls TensorRT

    version = trt.__version__
    for plan in plans:  # before any build: TensorRT 11 needs a graph in the precision asked
        check_graph_precision(plan, version)
    old = bundle.manifest.get("engines")
    old = old if isinstance(old, dict) else {}
    engines, built = {}, {}
    try:
        for plan in plans:
            if not force and is_up_to_date(old.get(plan.role), plan, gpu, version):
                print(f"{plan.engine} is up to date (use --force to rebuild)", file=sys.stderr)
                engines[plan.role] = old[plan.role]
                continue
            tmp = temp_path(plan.engine)
            built[plan.role] = tmp
            shape_inputs = engine_calls.build_engine(trt, plan, tmp, cache)
            engines[plan.role] = engine_record(
                plan.engine.name, tmp.stat().st_size, precision, plan.profiles, plan.capacity,
                gpu, version, plan.onnx.name, plan.onnx_file_size, shape_inputs)
        # Only now, with every engine built, replace the old ones; then the manifest. A
        # crash in between leaves an engine whose size the manifest does not match, which
        # engine_entry reports as "rebuild".
        for role, tmp in built.items():
            os.replace(tmp, bundle.root / f"{role}.engine")
    finally:
        for tmp in built.values():
            tmp.unlink(missing_ok=True)
    if engines == old:
        return bundle.manifest
    return write_engines_entry(bundle.root, engines)
