"""What `specedge build` will build, computed without a GPU: the arguments and the bundle
checked, the optimization profiles (runtime/backends/engine_manifest.py), how the TensorRT
version sets the precision (builder flags, or the graph's types), and whether an engine
already built is up to date."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

from specedge.runtime.backends.engine_manifest import (
    ENGINE_PRECISIONS,
    capacity_range,
    profile_shapes,
    profile_summary,
    tensorrt_major,
)
from specedge.runtime.bundle import Bundle, graph_io
from specedge.runtime.config import AUTO_MAX_K

DEFAULT_MAX_PROMPT = 2048
DEFAULT_MAX_DRAFT_TOKENS = AUTO_MAX_K  # `--draft-tokens auto` goes up to this
TIMING_CACHE = "timing.cache"

# Lowest compute capability with hardware support for each precision (fp16: Jetson TX1 / P100;
# int8 dp4a: 6.1; bf16: Ampere; fp8: Ada / Hopper).
MIN_CAPABILITY = {"fp32": (0, 0), "fp16": (5, 3), "bf16": (8, 0), "int8": (6, 1),
                  "fp8": (8, 9)}
# int8 / fp8 engines come only from explicitly quantized graphs (Q/DQ nodes); their other
# layers run in fp16 rather than fp32.
_FLAGS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",), "int8": ("INT8", "FP16"),
          "fp8": ("FP8", "FP16")}
# The float precisions `specedge export` writes graphs in (models.<role>.precision).
EXPORT_FLOAT_PRECISIONS = ("fp32", "fp16")


def strongly_typed(tensorrt_version: str) -> bool:
    """Whether `specedge build` makes a strongly typed network on this TensorRT.

    TensorRT 11 builds strongly typed networks only: the graph's tensor types set each layer's
    precision, and BuilderFlag FP16 / BF16 / INT8 / FP8 / PREFER_PRECISION_CONSTRAINTS,
    `ILayer.precision` and `ILayer.set_output_type` are gone (deprecated in 10.12; absent from
    the 11.0 bindings, NVIDIA/TensorRT python/src/infer/pyCore.cpp and pyGraph.cpp at tag
    v11.0, and listed as removed in the 10.x -> 11.x Python migration guide). TensorRT 10
    keeps the weakly typed build: precision flags and fp32 pins, which work from 10.0 on.
    BackendUnavailableError for other versions (engine_manifest.tensorrt_major).
    """
    return tensorrt_major(tensorrt_version) >= 11


def builder_flags(precision: str, strong: bool = False) -> tuple[tuple[str, ...],
                                                                 tuple[str, ...]]:
    """(trt.BuilderFlag names to set, names to clear) for an engine precision; `strong` for a
    strongly typed network (`strongly_typed`).

    fp32 clears TF32 (on by default, and still a flag in TensorRT 11), so an fp32 engine does
    fp32 matmuls like the ONNX graph. Weakly typed fp16 / bf16 ask TensorRT to honour the
    fp32 pins on normalisation and softmax layers (PREFER, not OBEY: a pin TensorRT cannot
    honour is a warning, not a failed build). A strongly typed network takes no precision
    flag (TensorRT 10 rejects them there, 11 has none): its graph's types decide.
    """
    check_precision(precision)
    clear = ("TF32",) if precision == "fp32" else ()
    if strong:
        return (), clear
    pins = ("PREFER_PRECISION_CONSTRAINTS",) if precision in ("fp16", "bf16") else ()
    return _FLAGS[precision] + pins, clear


def check_precision(precision: str) -> str:
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(ENGINE_PRECISIONS)}, "
                         f"got {precision!r}")
    return precision


def check_precision_supported(precision: str, gpu: tuple[str, tuple[int, int]]) -> None:
    """ValueError when the GPU's compute capability lacks the precision."""
    need = MIN_CAPABILITY[check_precision(precision)]
    name, have = gpu
    if tuple(have) < need:
        fallback = "fp16" if tuple(have) >= MIN_CAPABILITY["fp16"] else "fp32"
        raise ValueError(f"--precision {precision} needs compute capability "
                         f"{need[0]}.{need[1]} or newer; {name} has {have[0]}.{have[1]}: "
                         f"use --precision {fallback}")


def graph_markers(path: Path, markers: tuple[bytes, ...]) -> set[bytes]:
    """Which of `markers` occur in the file. An ONNX op type is stored as plain bytes in the
    protobuf, so this finds ops without the onnx package (which the device need not have)."""
    if path.stat().st_size == 0:
        return set()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return {marker for marker in markers if m.find(marker) != -1}


def check_graph_ops(path: Path, precision: str) -> None:
    """ValueError for graphs TensorRT cannot build at `precision` (cheap, before TensorRT)."""
    found = graph_markers(path, (b"MatMulNBits", b"QuantizeLinear", b"DequantizeLinear"))
    if b"MatMulNBits" in found:
        raise ValueError(f"{path.name} holds MatMulNBits weight-only quantization, an ONNX "
                         "Runtime operator TensorRT cannot parse: re-export the bundle with "
                         "`specedge export --precision fp32` (or fp16) for TensorRT")
    if precision in ("int8", "fp8") and not found & {b"QuantizeLinear", b"DequantizeLinear"}:
        raise ValueError(f"--precision {precision} needs an explicitly quantized graph "
                         f"(QuantizeLinear/DequantizeLinear nodes) and {path.name} has none; "
                         "TensorRT 10 would run it in fp16 and call it int8/fp8: use "
                         "--precision fp16 (or bf16)")


@dataclass(frozen=True)
class EnginePlan:
    """One engine to build: from which graph, into which file, with which profiles."""

    role: str
    onnx: Path
    onnx_file_size: int
    engine: Path
    precision: str
    num_layers: int
    capacity: tuple[int, int, int]
    profiles: list[dict]
    graph_precision: str | None = None  # the manifest's models.<role>.precision


def check_graph_precision(plan: EnginePlan, tensorrt_version: str) -> None:
    """ValueError when this TensorRT cannot give the engine the precision asked.

    On a strongly typed network (TensorRT 11) the graph's types are the engine's precision:
    an fp16 engine needs a graph exported in fp16, an fp32 engine an fp32 graph. int8 / fp8
    take theirs from the graph's Q/DQ nodes (check_graph_ops). TensorRT 10 converts with
    flags, from any float graph.
    """
    if not strongly_typed(tensorrt_version) or plan.precision in ("int8", "fp8") \
            or plan.graph_precision == plan.precision:
        return
    name = plan.onnx.name
    if plan.graph_precision not in EXPORT_FLOAT_PRECISIONS:
        raise ValueError(f"TensorRT {tensorrt_version} takes the engine's precision from the "
                         f"graph's types, and the manifest does not say which float precision "
                         f"{name} holds ({plan.graph_precision!r}): re-export the bundle with "
                         "`specedge export MODEL --precision fp16` (or fp32)")
    if plan.precision in EXPORT_FLOAT_PRECISIONS:
        export = (f"re-export the bundle with `specedge export MODEL --precision "
                  f"{plan.precision}` for an {plan.precision} engine")
    else:
        export = f"specedge export writes no {plan.precision} graphs"
    raise ValueError(f"TensorRT {tensorrt_version} takes the engine's precision from the "
                     f"graph's types, and {name} is {plan.graph_precision}: build with "
                     f"--precision {plan.graph_precision}, or {export}")


def plan_builds(bundle: Bundle, precision: str = "fp16", max_prompt: int | None = None,
                max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                max_context: int | None = None, max_batch: int = 1) -> list[EnginePlan]:
    """Validate everything that needs no GPU and compute each engine's profiles
    (`max_batch` > 1: engines that also run calls on several sequences' rows at once,
    for `specedge serve --max-batch`)."""
    check_precision(precision)
    if not isinstance(max_draft_tokens, int) or isinstance(max_draft_tokens, bool) \
            or max_draft_tokens < 1:
        raise ValueError(f"--max-draft-tokens must be an integer >= 1, "
                         f"got {max_draft_tokens!r}")
    models = [("target", bundle.target)] + ([("draft", bundle.draft)] if bundle.draft else [])
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"--max-batch must be an integer >= 1, got {max_batch!r}")
    if max_batch > 1 and not all(spec.batch_rows for _, spec in models):
        raise ValueError("this bundle's graphs take one row a call (bundle format 3 or "
                         "older): re-export it with `specedge export MODEL --attention "
                         "portable` to build engines with --max-batch")
    if bundle.target.features:
        raise ValueError("this bundle has a feature draft, which TensorRT engines do not "
                         "run yet: export the bundle with a model draft (--draft-layers N "
                         "or a model draft folder) to build engines")
    context = min(spec.max_context for _, spec in models)
    if max_context is not None:
        if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
            raise ValueError(f"--max-context must be an integer >= 1, got {max_context!r}")
        if max_context > context:
            raise ValueError(f"--max-context {max_context} exceeds the bundle's context of "
                             f"{context}: pass {context} or less")
        context = max_context
    if max_prompt is None:
        max_prompt = min(DEFAULT_MAX_PROMPT, context)
    elif not isinstance(max_prompt, int) or isinstance(max_prompt, bool) or max_prompt < 1:
        raise ValueError(f"--max-prompt must be an integer >= 1, got {max_prompt!r}")
    elif max_prompt > context:
        raise ValueError(f"--max-prompt {max_prompt} exceeds the context of {context}: pass "
                         f"{context} or less (or a larger --max-context)")
    capacity = capacity_range(context)
    plans = []
    entries = bundle.manifest.get("models") or {}
    for role, spec in models:
        check_graph_ops(spec.path, precision)
        graph_precision = (entries.get(role) or {}).get("precision")
        # The draft mostly runs one token per step; the target verifies K + 1 at once.
        decode_opt = 1 if role == "draft" else None
        profiles = profile_shapes(spec, max_prompt, max_draft_tokens + 1, capacity,
                                  decode_opt=decode_opt, max_batch=max_batch)
        plans.append(EnginePlan(role=role, onnx=spec.path, onnx_file_size=spec.file_size,
                                engine=bundle.root / f"{role}.engine", precision=precision,
                                num_layers=spec.num_layers, capacity=capacity,
                                profiles=profiles, graph_precision=graph_precision))
    return plans


def check_io_names(inputs: list[str], outputs: list[str], num_layers: int) -> None:
    """RuntimeError when the parsed network's I/O is not the bundle contract's."""
    want_in, want_out = graph_io(num_layers)
    if sorted(inputs) != sorted(want_in) or sorted(outputs) != sorted(want_out):
        missing = sorted(set(want_in + want_out) - set(inputs + outputs))
        extra = sorted(set(inputs + outputs) - set(want_in + want_out))
        raise RuntimeError(f"the graph's inputs/outputs are not the bundle contract's (missing "
                           f"{missing or 'none'}, unexpected {extra or 'none'}): re-export the "
                           "bundle with `specedge export`")


def is_up_to_date(entry: object, plan: EnginePlan, gpu: tuple[str, tuple[int, int]],
                  tensorrt_version: str) -> bool:
    """True if `entry` (the manifest's engine record) describes an engine built from the same
    graph with the same precision and profiles, on this GPU and TensorRT version, and its
    file is there with the recorded size."""
    if not isinstance(entry, dict):
        return False
    path = plan.engine.parent / str(entry.get("file"))
    # An entry written before profiles recorded their rows was built for one row.
    profiles = [dict({"rows": [1, 1, 1]}, **p) if isinstance(p, dict) else p
                for p in entry.get("profiles") or []]
    same = (entry.get("file") == plan.engine.name
            and entry.get("precision") == plan.precision
            and profiles == profile_summary(plan.profiles)
            and entry.get("capacity") == list(plan.capacity)
            and entry.get("gpu") == {"name": gpu[0], "compute_capability": list(gpu[1])}
            and entry.get("tensorrt_version") == tensorrt_version
            and entry.get("onnx_file") == plan.onnx.name
            and entry.get("onnx_file_size") == plan.onnx_file_size)
    return same and path.is_file() and path.stat().st_size == entry.get("file_size")
