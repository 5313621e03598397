"""The TensorRT calls of `specedge build`: ONNX graph -> serialized engine file.

Kept thin on purpose: every decision (profiles, flags, strong or weak typing, which layers
stay fp32, file handling) is made by pure, tested code in tensorrt/plan.py and
runtime/backends/engine_manifest.py. This module cannot run without a GPU, so CI does not run
it; scripts/gpu_check.sh does, on a CUDA machine. CI runs it against strict stand-ins for the
TensorRT 10 and 11 bindings (tests/export/test_tensorrt_build.py).
The `trt` module is passed in (tensorrt/build.py, `preflight`, imports and checks it).

The names, argument orders and return values used here were checked against the Python
bindings in NVIDIA/TensorRT (python/src/infer/pyCore.cpp, pyGraph.cpp and
python/src/parsers/pyOnnx.cpp at tags v10.0.0, v10.3.0, v10.16 and v11.0): Builder(logger),
create_network(flags), OnnxParser(network, logger), set_timing_cache(cache, ignore_mismatch),
build_serialized_network(network, config) -> IHostMemory or None.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType

from specedge.export.tensorrt.plan import (
    EnginePlan,
    builder_flags,
    check_io_names,
    strongly_typed,
)
from specedge.runtime.atomic_files import atomic_write
from specedge.runtime.backends.engine_manifest import SUPPORTED_TENSORRT

# Layers kept in fp32 in fp16/bf16 engines: normalisation (a mean of squares overflows fp16)
# and softmax. The exporter's RMSNorm is a Pow/ReduceMean/Sqrt/Div chain named after the HF
# module (".../input_layernorm/Pow", ".../norm/Div"); GPT-2's LayerNorm is "/ln_1/...".
_NORM_SCOPE = re.compile(r"(^|/)[^/]*(norm|ln_)[^/]*(/|$)", re.IGNORECASE)
_NEVER_PIN = ("CONSTANT", "SHAPE", "ASSERTION")


def pins_fp32(layer_name: str, kind: str) -> bool:
    """Whether a layer (its name, and its trt.LayerType name) should run in fp32."""
    if kind in ("SOFTMAX", "NORMALIZATION"):
        return True
    return kind not in _NEVER_PIN and bool(_NORM_SCOPE.search(layer_name))


def _pin_layers(trt: ModuleType, network) -> int:
    # Weakly typed networks only (TensorRT 10): ILayer.precision and set_output_type are gone
    # in TensorRT 11, where the graph's own types keep a layer in fp32.
    kinds = {getattr(trt.LayerType, n): n for n in ("SOFTMAX", "NORMALIZATION") + _NEVER_PIN
             if hasattr(trt.LayerType, n)}
    floats = [trt.float32, trt.float16] + ([trt.bfloat16] if hasattr(trt, "bfloat16") else [])
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outputs = [layer.get_output(j) for j in range(layer.num_outputs)]
        # Integer outputs (shapes, indices) must keep their type.
        if not pins_fp32(layer.name, kinds.get(layer.type, "OTHER")) \
                or any(o.dtype not in floats for o in outputs):
            continue
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            layer.set_output_type(j, trt.float32)
        pinned += 1
    return pinned


def _logger(trt: ModuleType):
    class Logger(trt.ILogger):
        """Keeps errors for the exception message and warnings for a short summary."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(str(msg))
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(str(msg))

    return Logger()


def _monitor(trt: ModuleType, label: str):
    """A progress monitor: a tqdm bar per builder phase (a line per top-level phase without
    tqdm). Ctrl-C sets `cancelled`; step_complete then returns False and TensorRT stops the
    build cleanly (an exception must never escape into TensorRT's C++ threads)."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.cancelled = False
            self._lock = threading.Lock()
            self._bars: dict[str, object] = {}
            self._depth: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                with self._lock:
                    depth = self._depth.get(parent_phase, -1) + 1 if parent_phase else 0
                    self._depth[phase_name] = depth
                    if tqdm is not None:
                        self._bars[phase_name] = tqdm(total=num_steps, position=depth,
                                                      desc=f"{label}: {phase_name}",
                                                      leave=False, file=sys.stderr)
                    elif depth == 0:
                        print(f"{label}: {phase_name}", file=sys.stderr, flush=True)
            except Exception:  # progress must never break the build
                pass

        def step_complete(self, phase_name, step):
            try:
                with self._lock:
                    bar = self._bars.get(phase_name)
                    if bar is not None:
                        bar.update(step + 1 - bar.n)
            except Exception:
                pass
            return not self.cancelled

        def phase_finish(self, phase_name):
            try:
                with self._lock:
                    bar = self._bars.pop(phase_name, None)
                    if bar is not None:
                        bar.close()
            except Exception:
                pass

    return Monitor()


def _set_timing_cache(config, path: Path) -> None:
    data = path.read_bytes() if path.is_file() else b""
    cache = None
    try:
        cache = config.create_timing_cache(data)
    except Exception:  # a corrupt cache file only makes the build slower
        pass
    # False: a cache from another TensorRT version or GPU is rejected; start a fresh one.
    if cache is None or not config.set_timing_cache(cache, False):
        print(f"ignoring timing cache {path}: it is from another GPU or TensorRT version",
              file=sys.stderr)
        config.set_timing_cache(config.create_timing_cache(b""), False)


def _add_profiles(builder, network, config, plan: EnginePlan) -> list[str]:
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    shape_inputs = [t.name for t in inputs if t.is_shape_tensor]
    for p in plan.profiles:
        profile = builder.create_optimization_profile()
        for t in inputs:
            if t.is_shape_tensor:
                if t.name not in p["values"]:
                    raise RuntimeError(f"TensorRT treats input {t.name!r} as a shape tensor and "
                                       "the build has no value range for it")
                lo, opt, hi = p["values"][t.name]
                profile.set_shape_input(t.name, (lo,), (opt,), (hi,))
            else:
                profile.set_shape(t.name, *p["shapes"][t.name])
        index = config.add_optimization_profile(profile)
        if index != p["index"]:
            raise RuntimeError(f"TensorRT numbered the {p['name']} profile {index}, "
                               f"expected {p['index']}")
    return shape_inputs


def build_engine(trt: ModuleType, plan: EnginePlan, out: Path, timing_cache: Path) -> list[str]:
    """Build `plan` into the file `out`; returns the inputs TensorRT made shape tensors.

    Updates `timing_cache`. RuntimeError (with TensorRT's own errors) if parsing or building
    fails, or if this TensorRT's Python API lacks a name or signature used here;
    KeyboardInterrupt if the user pressed Ctrl-C.
    """
    try:
        return _build_engine(trt, plan, out, timing_cache)
    except (AttributeError, TypeError) as e:
        # A TensorRT whose bindings differ from the ones this module was checked against
        # (a name removed, a signature changed) raises these: the user gets one line saying
        # what to install, not a traceback.
        low, high = SUPPORTED_TENSORRT[0], SUPPORTED_TENSORRT[-1]
        raise RuntimeError(
            f"the Python API of TensorRT {getattr(trt, '__version__', '?')} is not the one "
            f"specedge build knows ({type(e).__name__}: {e}): install a TensorRT "
            f"{low}.x-{high}.x release with its builder and ONNX parser (pip install "
            f"'tensorrt>={low},<{high + 1}'; on Jetson, JetPack 6.1 or later), and report "
            "this message if it persists") from e


def _build_engine(trt: ModuleType, plan: EnginePlan, out: Path, timing_cache: Path) -> list[str]:
    strong = strongly_typed(trt.__version__)
    label = f"build {plan.role}"
    typing = "strongly typed, precision from the graph" if strong else "precision flags"
    print(f"{label}: {plan.onnx.name} -> {plan.engine.name} ({plan.precision}, TensorRT "
          f"{trt.__version__}, {typing})", file=sys.stderr, flush=True)
    logger = _logger(trt)
    builder = trt.Builder(logger)
    # TensorRT 10: 0 is explicit batch, its only mode, and weak typing. TensorRT 11: every
    # network is strongly typed and the flag is deprecated but accepted ("retained for API
    # compatibility but ignored", 11.0 Python API docs); pass it while it exists.
    flags = 0
    if strong and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # From a file path, so weights saved as external data beside the graph resolve.
    if not parser.parse_from_file(str(plan.onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT cannot parse {plan.onnx}: "
                           f"{'; '.join(errors or logger.errors) or 'no details'}")
    check_io_names([network.get_input(i).name for i in range(network.num_inputs)],
                   [network.get_output(i).name for i in range(network.num_outputs)],
                   plan.num_layers)

    config = builder.create_builder_config()
    set_flags, clear_flags = builder_flags(plan.precision, strong)
    for name in set_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in clear_flags:
        config.clear_flag(getattr(trt.BuilderFlag, name))
    if plan.precision in ("fp16", "bf16") and not strong:
        pinned = _pin_layers(trt, network)
        print(f"{label}: {pinned} normalisation/softmax layers kept in fp32", file=sys.stderr)
    shape_inputs = _add_profiles(builder, network, config, plan)
    _set_timing_cache(config, timing_cache)

    monitor = _monitor(trt, label)
    config.progress_monitor = monitor
    previous = None
    if threading.current_thread() is threading.main_thread():
        def cancel(signum, frame):
            monitor.cancelled = True
        previous = signal.signal(signal.SIGINT, cancel)
    try:
        serialized = builder.build_serialized_network(network, config)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if monitor.cancelled:
        raise KeyboardInterrupt
    if serialized is None:  # IBuilder::buildSerializedNetwork returns nullptr on failure
        raise RuntimeError(f"TensorRT could not build the {plan.role} engine: "
                           f"{'; '.join(logger.errors[-3:]) or 'no details'}")
    with open(out, "wb") as f:
        f.write(serialized)
    atomic_write(timing_cache, config.get_timing_cache().serialize())
    warnings = list(dict.fromkeys(logger.warnings))
    if warnings:
        print(f"{label}: {len(warnings)} TensorRT warnings, e.g. {warnings[0]}",
              file=sys.stderr)
    return shape_inputs
