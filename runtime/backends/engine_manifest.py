"""TensorRT engines in a bundle: optimization profiles and the manifest's `engines` entry.

Pure functions (no TensorRT, no torch): `specedge build` plans with them and the TensorRT
runtime reads with them, so both sides agree on the format and it is tested without a GPU.

`manifest["engines"]` holds one entry per role ("target", "draft"):

    file, file_size          the serialized engine beside manifest.json
    precision                fp16 | bf16 | fp32 | fp8 | int8
    profiles                 [{name: "prefill", index: 0, tokens: [min, opt, max],
                               logits_to_keep: [min, opt, max], rows: [min, opt, max]},
                              {name: "decode", index: 1, ...}]
    capacity                 [min, opt, max] KV-cache rows (C) the engine accepts
    gpu                      {name, compute_capability: [major, minor]}
    tensorrt_version, built_at, onnx_file, onnx_file_size, shape_inputs

Profile 0 ("prefill") serves prompts of 1..max_prompt tokens with one kept logit row; profile 1
("decode") serves draft steps and verification, 1..K_max+1 tokens with up to K_max+1 rows.
`rows` is the batch dimension B of input_ids [B, T] (sequences decoded together,
runtime/batch.py): 1 for prefill, 1..max_batch for decode, whose tokens then reach
MAX_BATCHED_TOKENS, the most a row of a batched call takes (an entry without `rows` was
built for one row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.backends.gpu_info import gpu_identity
from specedge.runtime.bundle import MANIFEST, Bundle, ModelSpec, graph_io
from specedge.runtime.errors import BackendUnavailableError, BundleError
from specedge.runtime.kv_cache import CAPACITY_STEP, MAX_BATCHED_TOKENS

__all__ = ["ENGINE_PRECISIONS", "EngineSpec", "ProfileSpec", "capacity_range",
           "check_engine_compatible", "check_max_batch", "engine_entry", "engine_record",
           "gpu_identity",
           "profile_for", "profile_shapes", "profile_summary", "SUPPORTED_TENSORRT",
           "tensorrt_major"]

ENGINE_PRECISIONS = ("fp16", "bf16", "fp32", "fp8", "int8")
# The TensorRT major versions whose Python API the build and the runtime are written for:
# 10 builds weakly typed networks with precision flags, 11 strongly typed ones only. JetPack
# 6.1 and 6.2 ship TensorRT 10.3 (TensorRT 11's migration guide lists JetPack as unsupported);
# `pip install tensorrt` resolves to 11.x elsewhere.
SUPPORTED_TENSORRT = (10, 11)
PROFILE_NAMES = ("prefill", "decode")
# TensorRT tunes kernels for the `opt` shape. A chat prompt is rarely longer than this, and a
# generation's cache (prompt + new tokens, rounded to CAPACITY_STEP) is rarely larger.
PREFILL_OPT_TOKENS = 256
CAPACITY_OPT = 1024

Range = tuple[int, int, int]


def tensorrt_major(version: object) -> int:
    """The major version of TensorRT `version` (trt.__version__, e.g. "10.3.0.30");
    BackendUnavailableError saying what to install when it is not one of SUPPORTED_TENSORRT."""
    head = str(version).split(".", 1)[0]
    major = int(head) if head.isdigit() else None
    if major not in SUPPORTED_TENSORRT:
        supported = " and ".join(f"{m}.x" for m in SUPPORTED_TENSORRT)
        raise BackendUnavailableError(
            f"TensorRT {version} is not supported: specedge supports TensorRT {supported}; "
            f"pip install 'tensorrt>={SUPPORTED_TENSORRT[0]},<{SUPPORTED_TENSORRT[-1] + 1}' "
            "(on Jetson, JetPack 6.1 or later, which ships TensorRT 10.3)")
    return major


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: Any) -> Range:
    if (not isinstance(value, (tuple, list)) or len(value) != 3 or not all(map(_is_int, value))
            or not 1 <= value[0] <= value[1] <= value[2]):
        raise ValueError(f"{name} must be three integers 1 <= min <= opt <= max, got {value!r}")
    return tuple(value)


def capacity_range(max_context: int) -> Range:
    """KV capacities an engine accepts. The runtime rounds capacity up to a multiple of
    CAPACITY_STEP, capped at the context (kv_cache.capacity_for), so the smallest it asks for is
    one step (or the whole context, when that is shorter) and the largest is the context."""
    if not _is_int(max_context) or max_context < 1:
        raise ValueError(f"max_context (--max-context) must be an integer >= 1, "
                         f"got {max_context!r}")
    low = min(CAPACITY_STEP, max_context)
    return low, min(max_context, max(low, CAPACITY_OPT)), max_context


def profile_shapes(spec: ModelSpec, max_prompt: int, max_verify: int,
                   capacity: tuple[int, int, int], decode_opt: int | None = None,
                   max_batch: int = 1) -> list[dict]:
    """The two optimization profiles of one graph: "prefill" and "decode".

    Each: {"name", "index", "tokens": (min, opt, max), "logits_to_keep": (min, opt, max),
    "rows": (min, opt, max), "capacity": (min, opt, max), "shapes": {input: (min_shape,
    opt_shape, max_shape)} for every graph input, "values": {input: (min, opt, max)}}.
    "values" are the value ranges of the scalar inputs: TensorRT makes `logits_to_keep` a
    shape tensor (it feeds a Slice), and a shape-tensor input needs the range of its value
    rather than of its shape.

    `max_verify` is K_max + 1 (a verification feeds the last token and K drafts);
    `decode_opt` is the usual decode length (default max_verify; the draft mostly runs 1);
    `max_batch` > 1: the decode profile also takes calls of 1..max_batch rows (batched
    decoding, tuned for max_batch rows) of up to MAX_BATCHED_TOKENS tokens each.
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec (bundle.target or bundle.draft), "
                         f"got {type(spec).__name__}")
    if not _is_int(max_prompt) or max_prompt < 1:
        raise ValueError(f"max_prompt (--max-prompt) must be an integer >= 1, got {max_prompt!r}")
    if not _is_int(max_verify) or max_verify < 2:
        raise ValueError("max_verify must be an integer >= 2 (K_max + 1, with "
                         f"--max-draft-tokens K_max >= 1), got {max_verify!r}")
    c_min, c_opt, c_max = _check_range("capacity", capacity)
    if c_max > spec.max_context:
        raise ValueError(f"a KV capacity of {c_max} exceeds the model's context of "
                         f"{spec.max_context}: pass --max-context {spec.max_context} or less")
    for name, flag, value in (("max_prompt", "--max-prompt", max_prompt),
                              ("max_verify", "--max-draft-tokens", max_verify)):
        if value > c_max:
            raise ValueError(f"{name} ({value}) exceeds the KV capacity ({c_max}): pass a "
                             f"smaller {flag} or a larger --max-context")
    decode_opt = max_verify if decode_opt is None else decode_opt
    if not _is_int(decode_opt) or not 1 <= decode_opt <= max_verify:
        raise ValueError(f"decode_opt must be an integer in 1..{max_verify}, got {decode_opt!r}")
    if not _is_int(max_batch) or max_batch < 1:
        raise ValueError(f"max_batch (--max-batch) must be an integer >= 1, got {max_batch!r}")
    decode_max = max_verify if max_batch == 1 else max(max_verify, MAX_BATCHED_TOKENS)
    if decode_max > c_max:
        raise ValueError(f"calls of {decode_max} tokens exceed the KV capacity ({c_max}): "
                         "pass a larger --max-context")

    inputs, _ = graph_io(spec.num_layers)
    heads, dim = spec.num_kv_heads, spec.head_dim

    def profile(index: int, tokens: Range, keep: Range, rows: Range, past_opt: int) -> dict:
        shapes = {}
        for name in inputs:
            if name in ("input_ids", "position_ids"):
                shapes[name] = tuple((b, t) for b, t in zip(rows, tokens))
            elif name == "past_length":
                shapes[name] = tuple((b,) for b in rows)
            elif name == "logits_to_keep":
                shapes[name] = ((1,), (1,), (1,))
            else:
                shapes[name] = tuple((b, heads, c, dim)
                                     for b, c in zip(rows, (c_min, c_opt, c_max)))
        # past_length + T <= capacity; its range only matters if TensorRT makes it a shape
        # tensor (it does not feed a shape in our graphs, but the range is recorded anyway).
        values = {"logits_to_keep": keep, "past_length": (0, past_opt, c_max - 1)}
        return {"name": PROFILE_NAMES[index], "index": index, "tokens": tokens,
                "logits_to_keep": keep, "rows": rows, "capacity": (c_min, c_opt, c_max),
                "shapes": shapes, "values": values}

    prefill = profile(0, (1, min(max_prompt, PREFILL_OPT_TOKENS), max_prompt), (1, 1, 1),
                      (1, 1, 1), 0)
    decode = profile(1, (1, decode_opt, decode_max), (1, decode_opt, decode_max),
                     (1, max_batch, max_batch), c_opt // 2)
    return [prefill, decode]


def profile_summary(profiles: list[dict]) -> list[dict]:
    """The part of `profile_shapes` the manifest keeps (JSON lists)."""
    return [{"name": p["name"], "index": p["index"], "tokens": list(p["tokens"]),
             "logits_to_keep": list(p["logits_to_keep"]), "rows": list(p["rows"])}
            for p in profiles]


def engine_record(file: str, file_size: int, precision: str, profiles: list[dict],
                  capacity: tuple[int, int, int], gpu: tuple[str, tuple[int, int]],
                  tensorrt_version: str, onnx_file: str, onnx_file_size: int,
                  shape_inputs: list[str] | tuple[str, ...] = (),
                  built_at: str | None = None) -> dict:
    """One `manifest["engines"][role]` entry (see the module docstring)."""
    return {"file": file, "file_size": file_size, "precision": precision,
            "profiles": profile_summary(profiles), "capacity": list(capacity),
            "gpu": {"name": gpu[0], "compute_capability": list(gpu[1])},
            "tensorrt_version": tensorrt_version,
            "built_at": built_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "onnx_file": onnx_file, "onnx_file_size": onnx_file_size,
            "shape_inputs": list(shape_inputs)}


@dataclass(frozen=True)
class ProfileSpec:
    name: str
    index: int
    tokens: Range
    logits_to_keep: Range
    rows: Range = (1, 1, 1)


@dataclass(frozen=True)
class EngineSpec:
    """What the TensorRT runtime needs to know about one engine in the bundle."""

    path: Path
    profiles: tuple[ProfileSpec, ...]
    capacity: Range
    precision: str
    gpu: tuple[str, tuple[int, int]]
    tensorrt_version: str
    file_size: int = 0
    shape_inputs: tuple[str, ...] = ()


def _rebuild(root: Path) -> str:
    return f"rebuild the engines with `specedge build --bundle {root} --force`"


def _bad(root: Path, what: str) -> BundleError:
    return BundleError(f"{root / MANIFEST}: {what}; {_rebuild(root)}")


def _field(root: Path, entry: dict, path: str, key: str, kind: type, what: str) -> Any:
    value = entry.get(key)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok or (kind is int and value < 1) or (kind is str and not value):
        raise _bad(root, f"{path}.{key} must be {what}, got {value!r}")
    return value


def _range(root: Path, value: Any, path: str) -> Range:
    try:
        return _check_range(path, value)
    except ValueError as e:
        raise _bad(root, str(e)) from None


def _profiles(root: Path, value: Any, path: str) -> tuple[ProfileSpec, ...]:
    if not isinstance(value, list) or len(value) != len(PROFILE_NAMES):
        raise _bad(root, f"{path}.profiles must be a list of {len(PROFILE_NAMES)} profiles "
                         f"({', '.join(PROFILE_NAMES)}), got {value!r}")
    out = []
    for i, p in enumerate(value):
        where = f"{path}.profiles[{i}]"
        if not isinstance(p, dict):
            raise _bad(root, f"{where} must be an object, got {p!r}")
        name, index = p.get("name"), p.get("index")
        if name != PROFILE_NAMES[i] or index != i:
            raise _bad(root, f"{where} must be named {PROFILE_NAMES[i]!r} with index {i}, got "
                             f"name {name!r} index {index!r}")
        out.append(ProfileSpec(name, index, _range(root, p.get("tokens"), f"{where}.tokens"),
                               _range(root, p.get("logits_to_keep"),
                                      f"{where}.logits_to_keep"),
                               _range(root, p.get("rows", [1, 1, 1]), f"{where}.rows")))
    return tuple(out)


def _gpu(root: Path, value: Any, path: str) -> tuple[str, tuple[int, int]]:
    cc = value.get("compute_capability") if isinstance(value, dict) else None
    name = value.get("name") if isinstance(value, dict) else None
    if (not isinstance(name, str) or not name or not isinstance(cc, list) or len(cc) != 2
            or not all(_is_int(v) and v >= 0 for v in cc)):
        raise _bad(root, f"{path}.gpu must be {{name, compute_capability: [major, minor]}}, "
                         f"got {value!r}")
    return name, (cc[0], cc[1])


def engine_entry(bundle: Bundle, role: str) -> EngineSpec:
    """Read and validate `manifest["engines"][role]`; BundleError saying what to do if bad."""
    root = bundle.root
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    if role == "draft" and bundle.draft is None:
        raise BundleError(f"{root} has no draft model, so no draft engine: use --no-draft or "
                          "--drafter prompt-lookup")
    engines = bundle.manifest.get("engines")
    if engines is None or (isinstance(engines, dict) and role not in engines):
        which = "" if engines is None else f" for the {role}"
        raise BundleError(f"this bundle has no TensorRT engines{which}: run "
                          f"`specedge build --bundle {root}` on the device")
    if not isinstance(engines, dict) or not isinstance(engines[role], dict):
        raise _bad(root, f"engines.{role} is not an object")
    entry, path = engines[role], f"engines.{role}"
    file = _field(root, entry, path, "file", str, "a file name")
    size = _field(root, entry, path, "file_size", int, "a positive integer")
    precision = entry.get("precision")
    if precision not in ENGINE_PRECISIONS:
        raise _bad(root, f"{path}.precision must be one of {', '.join(ENGINE_PRECISIONS)}, "
                         f"got {precision!r}")
    profiles = _profiles(root, entry.get("profiles"), path)
    capacity = _range(root, entry.get("capacity"), f"{path}.capacity")
    gpu = _gpu(root, entry.get("gpu"), path)
    version = _field(root, entry, path, "tensorrt_version", str, "a version string")
    _field(root, entry, path, "built_at", str, "a time stamp")
    shape_inputs = entry.get("shape_inputs", [])
    if not isinstance(shape_inputs, list) or not all(isinstance(s, str) for s in shape_inputs):
        raise _bad(root, f"{path}.shape_inputs must be a list of input names, "
                         f"got {shape_inputs!r}")
    engine_path = root / file
    if not engine_path.is_file():
        raise BundleError(f"bundle file missing: {engine_path}; {_rebuild(root)}")
    actual = engine_path.stat().st_size
    if actual != size:
        raise BundleError(f"engine {engine_path} is {actual} bytes, the manifest says {size}: "
                          f"it is truncated or was replaced; {_rebuild(root)}")
    return EngineSpec(path=engine_path, profiles=profiles, capacity=capacity,
                      precision=precision, gpu=gpu, tensorrt_version=version, file_size=size,
                      shape_inputs=tuple(shape_inputs))


def check_engine_compatible(spec: EngineSpec, gpu_name: str, compute_capability: tuple[int, int],
                            tensorrt_version: str) -> None:
    """BundleError unless this machine (GPU model, compute capability, TensorRT version) is the
    one the engine was built on: a TensorRT engine runs only there."""
    built_name, built_cc = spec.gpu
    here_cc = tuple(compute_capability)
    if (built_name, tuple(built_cc), spec.tensorrt_version) == (gpu_name, here_cc,
                                                                 tensorrt_version):
        return
    differs = [what for what, same in (("GPU", built_name == gpu_name),
                                       ("compute capability", tuple(built_cc) == here_cc),
                                       ("TensorRT version", spec.tensorrt_version
                                        == tensorrt_version)) if not same]
    raise BundleError(
        f"{spec.path} was built for {built_name} (compute capability "
        f"{built_cc[0]}.{built_cc[1]}) with TensorRT {spec.tensorrt_version}; this machine is "
        f"{gpu_name} (compute capability {here_cc[0]}.{here_cc[1]}) with TensorRT "
        f"{tensorrt_version} (different {', '.join(differs)}): rebuild with "
        f"`specedge build --bundle {spec.path.parent}`")


def check_max_batch(spec: EngineSpec, max_batch: int) -> None:
    """ValueError saying how to rebuild unless the engine's calls carry `max_batch`
    sequences at once (its decode profile's rows)."""
    rows = next(p.rows[2] for p in spec.profiles if p.name == "decode")
    if max_batch > rows:
        raise ValueError(f"{spec.path.name} runs calls of {rows} sequence(s) at most, and "
                         f"{max_batch} at once were asked for: rebuild the engines with "
                         f"`specedge build --bundle {spec.path.parent} --max-batch "
                         f"{max_batch} --force`, or serve with --max-batch {rows}")


def profile_for(spec: EngineSpec, tokens: int, capacity: int, rows: int = 1) -> int:
    """Index of the optimization profile that serves a call of `rows` rows of `tokens` tokens
    with KV caches of `capacity` rows: the decode profile when it fits (draft steps,
    verification, a batch's calls), else the prefill profile. ValueError saying how to
    rebuild when none fits."""
    if not _is_int(tokens) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    if not _is_int(rows) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    c_min, _, c_max = spec.capacity
    root = spec.path.parent
    if not _is_int(capacity) or not c_min <= capacity <= c_max:
        raise ValueError(f"a KV cache of {capacity!r} rows is outside the engine's range "
                         f"{c_min}..{c_max}: rebuild with `specedge build --bundle {root} "
                         "--max-context N` for a larger context, or generate fewer tokens")
    by_name = {p.name: p for p in spec.profiles}
    for name in ("decode", "prefill"):
        p = by_name.get(name)
        if p is not None and tokens <= p.tokens[2] and rows <= p.rows[2]:
            return p.index
    check_max_batch(spec, rows)
    if rows > 1:
        raise ValueError(f"a call of {rows} rows of {tokens} tokens exceeds the engine's "
                         f"batched calls of {by_name['decode'].tokens[2]} tokens a row: "
                         "run longer calls one row at a time")
    longest = max(p.tokens[2] for p in spec.profiles)
    raise ValueError(f"a call of {tokens} tokens is longer than the engine's max prompt "
                     f"({longest}): rebuild with `specedge build --bundle {root} --max-prompt "
                     f"{tokens}` (or more), or shorten the prompt")
