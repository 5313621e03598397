"""`specedge build` and the engine manifest, without TensorRT or a GPU (CPU only, fast).

Everything around the TensorRT calls is tested here: profiles, argument checks, the manifest's
`engines` entry, compatibility checks, profile choice, the build's orchestration (with the
TensorRT step replaced by a fake that writes bytes), the TensorRT versions accepted, and the
CLI when TensorRT is missing. export/tensorrt/engine_calls.py runs against strict stand-ins for the
TensorRT 10 and 11 bindings; its TensorRT calls themselves run only on a CUDA machine.
"""

from __future__ import annotations

import enum
import json
import re
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
from cuda_stand_in import GPU, fake_cudart
from test_cli import assert_one_line_error, call_main

from specedge.export.tensorrt import build as trt_build
from specedge.export.tensorrt import engine_calls as trt_calls
from specedge.export.tensorrt.build import build_engines
from specedge.export.tensorrt.engine_calls import pins_fp32
from specedge.export.tensorrt.plan import (
    EnginePlan,
    builder_flags,
    check_graph_ops,
    check_graph_precision,
    check_io_names,
    check_precision_supported,
    is_up_to_date,
    plan_builds,
    strongly_typed,
)
from specedge.runtime.backends import gpu_info
from specedge.runtime.backends.engine_manifest import (
    EngineSpec,
    ProfileSpec,
    capacity_range,
    check_engine_compatible,
    engine_entry,
    engine_record,
    profile_for,
    profile_shapes,
    tensorrt_major,
)
from specedge.runtime.bundle import MANIFEST, ModelSpec, graph_io, load_bundle
from specedge.runtime.errors import BackendUnavailableError, BundleError
from specedge.runtime.kv_cache import CAPACITY_STEP, MAX_BATCHED_TOKENS

TRT_VERSION = "10.3.0"


def spec(max_context: int = 8192, layers: int = 3) -> ModelSpec:
    return ModelSpec(path=Path("target.onnx"), num_layers=layers, num_kv_heads=3, head_dim=64,
                     vocab_size=49152, max_context=max_context, dtype="float32", file_size=1)


@pytest.fixture
def bundle(tiny_bundle, tmp_path) -> Path:
    """A private copy of the tiny bundle (the session fixture must stay untouched)."""
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ---- profiles -------------------------------------------------------------------------------

def test_capacity_range_follows_the_runtime_rounding():
    assert capacity_range(8192) == (CAPACITY_STEP, 1024, 8192)
    assert capacity_range(512) == (CAPACITY_STEP, 512, 512)
    assert capacity_range(100) == (100, 100, 100)  # a context shorter than one step
    for context in (300, 2048, 4096, 32768):
        low, opt, high = capacity_range(context)
        # Each is a capacity the runtime asks for: a multiple of the step, or the context.
        assert low % CAPACITY_STEP == 0 and high == context
        assert opt % CAPACITY_STEP == 0 or opt == context
        assert low <= opt <= high


def test_profile_shapes_cover_every_input():
    s = spec()
    k = 8
    prefill, decode = profile_shapes(s, 2048, k + 1, capacity_range(s.max_context))
    inputs, _ = graph_io(s.num_layers)
    assert (prefill["name"], prefill["index"], decode["name"], decode["index"]) == \
        ("prefill", 0, "decode", 1)
    for p in (prefill, decode):
        assert list(p["shapes"]) == inputs
        for name, (low, opt, high) in p["shapes"].items():
            assert len(low) == len(opt) == len(high)
            assert all(a <= b <= c for a, b, c in zip(low, opt, high)), name
        assert p["shapes"]["past_length"] == p["shapes"]["logits_to_keep"] == ((1,),) * 3
        for name in inputs[4:]:
            assert [shape[2] for shape in p["shapes"][name]] == [256, 1024, 8192]
            assert all(shape[:2] == (1, 3) and shape[3] == 64 for shape in p["shapes"][name])
        assert p["values"]["past_length"][0] == 0
        assert p["values"]["past_length"][2] == 8192 - 1
    assert prefill["tokens"] == (1, 256, 2048)
    assert prefill["shapes"]["input_ids"] == ((1, 1), (1, 256), (1, 2048))
    assert prefill["values"]["logits_to_keep"] == prefill["logits_to_keep"] == (1, 1, 1)
    assert decode["tokens"] == (1, k + 1, k + 1)
    assert decode["shapes"]["position_ids"] == ((1, 1), (1, k + 1), (1, k + 1))
    assert decode["values"]["logits_to_keep"] == (1, k + 1, k + 1)


def test_profile_shapes_for_sequences_decoded_together():
    """--max-batch 4: the decode profile takes calls of 1..4 rows (tuned for 4) of up to
    MAX_BATCHED_TOKENS tokens a row, every input's batch dimension with it; prompts stay
    on one row."""
    s = spec()
    prefill, decode = profile_shapes(s, 2048, 9, capacity_range(s.max_context), max_batch=4)
    assert prefill["rows"] == (1, 1, 1)
    assert decode["rows"] == (1, 4, 4)
    assert decode["tokens"] == (1, 9, MAX_BATCHED_TOKENS)
    assert decode["values"]["logits_to_keep"] == (1, 9, MAX_BATCHED_TOKENS)
    assert decode["shapes"]["input_ids"] == ((1, 1), (4, 9), (4, MAX_BATCHED_TOKENS))
    assert decode["shapes"]["past_length"] == ((1,), (4,), (4,))
    assert decode["shapes"]["logits_to_keep"] == ((1,),) * 3
    assert decode["shapes"]["past_key_values.2.value"] == ((1, 3, 256, 64), (4, 3, 1024, 64),
                                                           (4, 3, 8192, 64))
    assert all(shape[0] == 1 for name, shapes in prefill["shapes"].items()
               for shape in shapes)
    # A K_max above MAX_BATCHED_TOKENS keeps its own verification length.
    _, wide = profile_shapes(s, 2048, 33, capacity_range(s.max_context), max_batch=2)
    assert wide["tokens"] == (1, 33, 33)
    with pytest.raises(ValueError, match="--max-batch"):
        profile_shapes(s, 2048, 9, capacity_range(s.max_context), max_batch=0)


def test_profile_shapes_decode_opt_and_short_prompt():
    _, decode = profile_shapes(spec(), 16, 5, (256, 256, 512), decode_opt=1)
    assert decode["tokens"] == (1, 1, 5) and decode["values"]["logits_to_keep"] == (1, 1, 5)
    prefill, _ = profile_shapes(spec(), 16, 5, (256, 256, 512))
    assert prefill["tokens"] == (1, 16, 16)


BAD_PROFILE_ARGS = [
    (dict(max_prompt=0), "--max-prompt"),
    (dict(max_prompt=2.5), "--max-prompt"),
    (dict(max_verify=1), "--max-draft-tokens"),
    (dict(capacity=(512, 256, 1024)), "min <= opt <= max"),
    (dict(capacity=(256, 512)), "three integers"),
    (dict(capacity=(256, 1024, 16384)), "--max-context 8192 or less"),
    (dict(max_prompt=4096, capacity=(256, 1024, 2048)), "smaller --max-prompt"),
    (dict(max_prompt=16, max_verify=600, capacity=(256, 512, 512)),
     "smaller --max-draft-tokens"),
    (dict(decode_opt=10), "decode_opt"),
]


@pytest.mark.parametrize("change, words", BAD_PROFILE_ARGS,
                         ids=[w for _, w in BAD_PROFILE_ARGS])
def test_profile_shapes_rejects_bad_arguments(change, words):
    args = dict(max_prompt=2048, max_verify=9, capacity=(256, 1024, 8192)) | change
    with pytest.raises(ValueError, match=re.escape(words)):
        profile_shapes(spec(), args["max_prompt"], args["max_verify"], args["capacity"],
                       decode_opt=change.get("decode_opt"))


def test_profile_shapes_needs_a_model_spec():
    with pytest.raises(ValueError, match="ModelSpec"):
        profile_shapes({"num_layers": 2}, 2048, 9, (256, 1024, 8192))


# ---- planning -------------------------------------------------------------------------------

def test_plan_builds_for_the_tiny_bundle(tiny_bundle):
    b = load_bundle(tiny_bundle)
    target, draft = plan_builds(b)
    assert (target.role, target.engine, draft.role, draft.engine) == \
        ("target", tiny_bundle / "target.engine", "draft", tiny_bundle / "draft.engine")
    assert target.capacity == (256, 512, 512)  # the tiny models' context is 512
    assert target.profiles[0]["tokens"] == (1, 256, 512)  # max prompt capped at the context
    assert target.profiles[1]["tokens"] == (1, 9, 9)  # K_max = 8
    assert draft.profiles[1]["tokens"] == (1, 1, 9)  # the draft mostly runs one token
    assert target.num_layers == 2 and draft.num_layers == 1
    assert set(draft.profiles[0]["shapes"]) == set(graph_io(1)[0])
    short = plan_builds(b, "bf16", max_prompt=64, max_draft_tokens=3, max_context=256)[0]
    assert short.precision == "bf16" and short.capacity == (256, 256, 256)
    assert short.profiles[0]["tokens"] == (1, 64, 64)
    assert short.profiles[1]["tokens"] == (1, 4, 4)


@pytest.mark.parametrize("kwargs, words", [
    (dict(precision="int4"), "--precision must be one of fp16, bf16, fp32, fp8, int8"),
    (dict(max_prompt=1000), "--max-prompt 1000 exceeds the context of 512"),
    (dict(max_prompt=0), "--max-prompt must be an integer >= 1"),
    (dict(max_context=1024), "--max-context 1024 exceeds the bundle's context of 512"),
    (dict(max_context=0), "--max-context must be an integer >= 1"),
    (dict(max_draft_tokens=0), "--max-draft-tokens must be an integer >= 1"),
    (dict(max_batch=0), "--max-batch must be an integer >= 1"),
    (dict(precision="int8"), "needs an explicitly quantized graph"),
    (dict(precision="fp8"), "QuantizeLinear/DequantizeLinear"),
])
def test_plan_builds_rejects_bad_arguments(tiny_bundle, kwargs, words):
    with pytest.raises(ValueError, match=words):
        plan_builds(load_bundle(tiny_bundle), **kwargs)


def test_engines_for_a_batch_need_graphs_that_take_several_rows(tiny_bundle):
    b = load_bundle(tiny_bundle)
    assert plan_builds(b, max_batch=4)[0].profiles[1]["rows"] == (1, 4, 4)
    one_row = replace(b, target=replace(b.target, batch_rows=False))
    with pytest.raises(ValueError, match="one row a call.*--attention portable"):
        plan_builds(one_row, max_batch=4)


def test_graph_checks(tmp_path):
    nbits = tmp_path / "nbits.onnx"
    nbits.write_bytes(b"\x00garbage\x12\x0bMatMulNBits\x00")
    with pytest.raises(ValueError, match="MatMulNBits.*--precision fp32"):
        check_graph_ops(nbits, "fp16")
    qdq = tmp_path / "qdq.onnx"
    qdq.write_bytes(b"\x00\x12\x10DequantizeLinear\x00")
    check_graph_ops(qdq, "int8")
    check_graph_ops(qdq, "fp8")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    check_graph_ops(empty, "fp16")


def test_builder_flags():
    assert builder_flags("fp16") == (("FP16", "PREFER_PRECISION_CONSTRAINTS"), ())
    assert builder_flags("bf16") == (("BF16", "PREFER_PRECISION_CONSTRAINTS"), ())
    assert builder_flags("fp32") == ((), ("TF32",))  # true fp32, like the ONNX graph
    assert builder_flags("int8") == (("INT8", "FP16"), ())
    assert builder_flags("fp8") == (("FP8", "FP16"), ())
    with pytest.raises(ValueError, match="--precision"):
        builder_flags("fp64")


def test_precision_needs_a_capable_gpu():
    check_precision_supported("fp8", ("NVIDIA H100", (9, 0)))
    check_precision_supported("fp16", GPU)
    with pytest.raises(ValueError, match=r"fp8 needs compute capability 8.9.*8.7: use "
                       "--precision fp16"):
        check_precision_supported("fp8", GPU)
    with pytest.raises(ValueError, match=r"bf16 needs compute capability 8.0.*Xavier has 7.2"):
        check_precision_supported("bf16", ("Xavier", (7, 2)))
    with pytest.raises(ValueError, match="use --precision fp32"):
        check_precision_supported("fp16", ("old", (5, 2)))


def test_io_names_must_be_the_contract():
    inputs, outputs = graph_io(2)
    check_io_names(inputs[::-1], outputs, 2)
    with pytest.raises(RuntimeError, match=r"missing \['logits_to_keep'\].*re-export"):
        check_io_names(inputs[:3] + inputs[4:], outputs, 2)
    with pytest.raises(RuntimeError, match="unexpected"):
        check_io_names(inputs + ["attention_mask"], outputs, 2)


PINNED = ["/input_layernorm/Pow", "/model/layers.0/post_attention_layernorm/ReduceMean",
          "/norm/Div", "/norm/Mul_1", "/ln_1/LayerNormalization", "/transformer/ln_f/Add",
          "/input_layernorm_1/Sqrt"]
NOT_PINNED = ["/MatMul", "/self_attn/q_proj/MatMul", "/mlp/act/Pow", "/Softmax_cast",
              "/lm_head/Gemm", "/embed_tokens/Gather"]


def test_pins_fp32_names_and_kinds():
    for name in PINNED:
        assert pins_fp32(name, "ELEMENTWISE"), name
    for name in NOT_PINNED:
        assert not pins_fp32(name, "MATRIX_MULTIPLY"), name
    assert pins_fp32("/Softmax", "SOFTMAX") and pins_fp32("anything", "NORMALIZATION")
    assert not pins_fp32("/norm/Constant_1", "CONSTANT")
    assert not pins_fp32("/norm/Shape", "SHAPE")


def test_pins_fp32_on_the_exported_graph(tiny_bundle):
    """The TensorRT parser names layers after the ONNX nodes: check the real names."""
    nodes = onnx.load(str(tiny_bundle / "target.onnx"), load_external_data=False).graph.node
    kind = {"Softmax": "SOFTMAX", "Constant": "CONSTANT", "Shape": "SHAPE"}
    pinned = {n.name for n in nodes if pins_fp32(n.name, kind.get(n.op_type, "OTHER"))}
    norm_ops = {n.name for n in nodes if "norm" in n.name and n.op_type != "Constant"}
    assert norm_ops and norm_ops <= pinned
    assert {n.op_type for n in nodes if n.name in pinned} <= \
        {"Cast", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Softmax"}
    assert not any(n.op_type in ("MatMul", "Gemm") for n in nodes if n.name in pinned)


# ---- the manifest's engines entry -----------------------------------------------------------

def fake_engines(root: Path, gpu=GPU, version=TRT_VERSION) -> dict:
    """Write engine files and their manifest entry as `specedge build` would."""
    b = load_bundle(root)
    engines = {}
    for plan in plan_builds(b):
        plan.engine.write_bytes(b"engine " + plan.role.encode() * 50)
        engines[plan.role] = engine_record(plan.engine.name, plan.engine.stat().st_size,
                                           plan.precision, plan.profiles, plan.capacity, gpu,
                                           version, plan.onnx.name, plan.onnx_file_size,
                                           ["logits_to_keep"])
    trt_build.write_engines_entry(root, engines)
    return engines


def test_engine_entry_round_trip(bundle):
    before = json.loads((bundle / MANIFEST).read_text())
    fake_engines(bundle)
    after = json.loads((bundle / MANIFEST).read_text())
    assert {k: v for k, v in after.items() if k != "engines"} == before
    b = load_bundle(bundle)
    target = engine_entry(b, "target")
    assert target.path == bundle / "target.engine"
    assert target.precision == "fp16" and target.gpu == GPU
    assert target.tensorrt_version == TRT_VERSION
    assert target.capacity == (256, 512, 512)
    assert target.profiles == (ProfileSpec("prefill", 0, (1, 256, 512), (1, 1, 1)),
                               ProfileSpec("decode", 1, (1, 9, 9), (1, 9, 9)))
    assert target.shape_inputs == ("logits_to_keep",)
    decode = target.profiles[1]
    assert (decode.name, decode.index, decode.tokens) == ("decode", 1, (1, 9, 9))
    assert target.file_size == (bundle / "target.engine").stat().st_size
    draft = engine_entry(b, "draft")
    assert draft.path == bundle / "draft.engine" and draft.profiles[1].tokens == (1, 1, 9)
    with pytest.raises(ValueError, match="role"):
        engine_entry(b, "drafter")


def test_engine_entry_without_engines(tiny_bundle):
    with pytest.raises(BundleError, match=r"this bundle has no TensorRT engines: run "
                       r"`specedge build --bundle .*` on the device"):
        engine_entry(load_bundle(tiny_bundle), "target")


def _set(key, value):
    def change(entry):
        entry[key] = value
    return change


BAD_ENTRIES = {
    "no-file": (_set("file", None), "engines.target.file must be a file name"),
    "size-not-int": (_set("file_size", "12"), "engines.target.file_size must be a positive"),
    "size-bool": (_set("file_size", True), "file_size must be a positive integer"),
    "precision": (_set("precision", "fp4"), "precision must be one of"),
    "profiles-missing": (_set("profiles", None), "profiles must be a list of 2 profiles"),
    "profile-order": (lambda e: e["profiles"].reverse(),
                      "engines.target.profiles[0] must be named 'prefill' with index 0"),
    "profile-tokens": (lambda e: e["profiles"][1].update(tokens=[1, 9]), "tokens must be three"),
    "profile-keep": (lambda e: e["profiles"][0].update(logits_to_keep=[2, 1, 1]),
                     "logits_to_keep must be three integers"),
    "capacity": (_set("capacity", [512, 256, 512]), "capacity must be three integers"),
    "gpu": (_set("gpu", {"name": "x"}), "gpu must be {name, compute_capability"),
    "gpu-cc": (_set("gpu", {"name": "x", "compute_capability": [8]}), "compute_capability"),
    "trt-version": (_set("tensorrt_version", 10), "tensorrt_version must be a version string"),
    "built-at": (_set("built_at", None), "built_at must be a time stamp"),
    "shape-inputs": (_set("shape_inputs", "logits_to_keep"), "shape_inputs must be a list"),
    "not-an-object": (None, "engines.target is not an object"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_engine_entry_rejects_bad_fields(bundle, case):
    change, words = BAD_ENTRIES[case]
    fake_engines(bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    if change is None:
        manifest["engines"]["target"] = ["target.engine"]
    else:
        change(manifest["engines"]["target"])
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as e:
        engine_entry(load_bundle(bundle), "target")
    message = str(e.value)
    assert words in message, message
    assert "specedge build --bundle" in message and "--force" in message


def test_engine_entry_checks_the_file(bundle):
    fake_engines(bundle)
    (bundle / "draft.engine").unlink()
    with pytest.raises(BundleError, match="bundle file missing: .*draft.engine.*specedge build"):
        engine_entry(load_bundle(bundle), "draft")
    (bundle / "target.engine").write_bytes(b"short")
    with pytest.raises(BundleError, match="target.engine is 5 bytes, the manifest says"):
        engine_entry(load_bundle(bundle), "target")


def test_engine_entry_for_a_bundle_without_draft(bundle):
    manifest = json.loads((bundle / MANIFEST).read_text())
    del manifest["models"]["draft"]
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no draft model"):
        engine_entry(load_bundle(bundle), "draft")


# ---- compatibility and profile choice -------------------------------------------------------

def engine_spec(max_prompt: int = 2048, k: int = 8, rows: int = 1) -> EngineSpec:
    return EngineSpec(path=Path("/bundles/smollm2/target.engine"),
                      profiles=(ProfileSpec("prefill", 0, (1, 256, max_prompt), (1, 1, 1)),
                                ProfileSpec("decode", 1, (1, k + 1, k + 1), (1, k + 1, k + 1),
                                            (1, rows, rows))),
                      capacity=(256, 1024, 8192), precision="fp16", gpu=GPU,
                      tensorrt_version=TRT_VERSION)


def test_compatible_engine_passes():
    check_engine_compatible(engine_spec(), GPU[0], GPU[1], TRT_VERSION)
    check_engine_compatible(engine_spec(), GPU[0], [8, 7], TRT_VERSION)


@pytest.mark.parametrize("here, differs", [
    (("NVIDIA H100 80GB HBM3", (9, 0), TRT_VERSION), "GPU, compute capability"),
    (("NVIDIA Jetson Orin Nano", (8, 7), TRT_VERSION), "different GPU)"),
    ((GPU[0], (8, 6), TRT_VERSION), "different compute capability)"),
    ((GPU[0], GPU[1], "10.8.0"), "different TensorRT version)"),
])
def test_incompatible_engine_says_rebuild(here, differs):
    with pytest.raises(BundleError) as e:
        check_engine_compatible(engine_spec(), *here)
    message = str(e.value)
    assert ("target.engine was built for NVIDIA Jetson AGX Orin (compute capability 8.7) "
            "with TensorRT 10.3.0; this machine is") in message
    assert f"{here[0]} (compute capability {here[1][0]}.{here[1][1]}) with TensorRT " \
        f"{here[2]}" in message
    assert differs in message
    assert message.endswith("rebuild with `specedge build --bundle /bundles/smollm2`")


def test_profile_for():
    s = engine_spec(max_prompt=2048, k=8)
    assert profile_for(s, 1, 256) == 1  # a draft step or plain decoding
    assert profile_for(s, 9, 1024) == 1  # verification of K = 8
    assert profile_for(s, 10, 1024) == 0  # a prompt
    assert profile_for(s, 2048, 8192) == 0
    with pytest.raises(ValueError, match=r"2049 tokens is longer than the engine's max prompt "
                       r"\(2048\): rebuild with `specedge build --bundle /bundles/smollm2 "
                       r"--max-prompt 2049`"):
        profile_for(s, 2049, 8192)
    with pytest.raises(ValueError, match=r"16384 rows is outside the engine's range "
                       r"256..8192: rebuild .*--max-context"):
        profile_for(s, 4, 16384)
    with pytest.raises(ValueError, match="tokens must be an integer >= 1"):
        profile_for(s, 0, 256)


def test_profile_for_calls_of_several_rows():
    s = engine_spec(max_prompt=2048, k=8, rows=4)
    assert profile_for(s, 1, 256, rows=4) == 1
    assert profile_for(s, 9, 1024, rows=2) == 1
    assert profile_for(s, 30, 1024, rows=1) == 0  # a prompt, on one row
    with pytest.raises(ValueError, match=r"target.engine runs calls of 4 sequence\(s\) at most, "
                       r"and 5 at once.*--max-batch 5 --force`, or serve with --max-batch 4"):
        profile_for(s, 1, 256, rows=5)
    with pytest.raises(ValueError, match="exceeds the engine's batched calls of 9 tokens a row"):
        profile_for(s, 10, 256, rows=2)
    with pytest.raises(ValueError, match="runs calls of 1 sequence"):
        profile_for(engine_spec(), 1, 256, rows=2)


# ---- build orchestration (TensorRT replaced by a fake) --------------------------------------

@pytest.fixture
def fake_trt(monkeypatch) -> list[EnginePlan]:
    """tensorrt and the GPU are there; building an engine writes bytes. Returns the plans built."""
    built: list[EnginePlan] = []

    def build_engine(trt, plan, out, cache):
        built.append(plan)
        out.write_bytes(f"{plan.role} {plan.precision} engine".encode())
        cache.write_bytes(b"timing")
        return ["logits_to_keep"]

    monkeypatch.setattr(trt_build, "import_tensorrt",
                        lambda: types.SimpleNamespace(__version__=TRT_VERSION))
    monkeypatch.setattr(trt_build, "gpu_identity", lambda: GPU)
    monkeypatch.setattr(trt_calls, "build_engine", build_engine)
    return built


def test_build_writes_engines_and_manifest(bundle, fake_trt, capsys):
    before = json.loads((bundle / MANIFEST).read_text())
    manifest = build_engines(bundle)
    assert [p.role for p in fake_trt] == ["target", "draft"]
    assert (bundle / "target.engine").read_bytes() == b"target fp16 engine"
    assert (bundle / "timing.cache").read_bytes() == b"timing"
    on_disk = json.loads((bundle / MANIFEST).read_text())
    assert on_disk == manifest
    assert {k: v for k, v in on_disk.items() if k != "engines"} == before
    b = load_bundle(bundle)
    for role in ("target", "draft"):
        e = engine_entry(b, role)
        assert e.gpu == GPU and e.tensorrt_version == TRT_VERSION and e.precision == "fp16"
        check_engine_compatible(e, GPU[0], GPU[1], TRT_VERSION)
    assert not [p for p in bundle.iterdir() if p.name.startswith(".")]  # no temporary files

    files = snapshot(bundle)
    capsys.readouterr()
    build_engines(bundle)  # up to date: nothing rebuilt, nothing rewritten
    assert len(fake_trt) == 2 and snapshot(bundle) == files
    assert "up to date" in capsys.readouterr().err
    build_engines(bundle, force=True)
    assert len(fake_trt) == 4
    build_engines(bundle, precision="bf16")
    assert len(fake_trt) == 6 and engine_entry(load_bundle(bundle), "draft").precision == "bf16"


def test_build_rebuilds_for_another_gpu_or_tensorrt(bundle, fake_trt, monkeypatch):
    build_engines(bundle)
    monkeypatch.setattr(trt_build, "import_tensorrt",
                        lambda: types.SimpleNamespace(__version__="10.9.0"))
    build_engines(bundle)
    assert len(fake_trt) == 4
    assert engine_entry(load_bundle(bundle), "target").tensorrt_version == "10.9.0"


def test_is_up_to_date(bundle, fake_trt):
    build_engines(bundle)
    b = load_bundle(bundle)
    entry = b.manifest["engines"]["target"]
    plan = plan_builds(b)[0]
    assert is_up_to_date(entry, plan, GPU, TRT_VERSION)
    assert not is_up_to_date(entry, plan, ("other", GPU[1]), TRT_VERSION)
    assert not is_up_to_date(entry, plan, GPU, "10.4.0")
    assert not is_up_to_date(entry, replace(plan, precision="bf16"), GPU, TRT_VERSION)
    assert not is_up_to_date(entry, replace(plan, onnx_file_size=1), GPU, TRT_VERSION)
    assert not is_up_to_date(entry, plan_builds(b, max_prompt=128)[0], GPU, TRT_VERSION)
    assert not is_up_to_date(None, plan, GPU, TRT_VERSION)
    assert not is_up_to_date(entry, plan_builds(b, max_batch=4)[0], GPU, TRT_VERSION)
    # An entry written before profiles recorded their rows was built for one row.
    older = dict(entry, profiles=[{k: v for k, v in p.items() if k != "rows"}
                                  for p in entry["profiles"]])
    assert is_up_to_date(older, plan, GPU, TRT_VERSION)
    manifest = dict(b.manifest, engines=dict(b.manifest["engines"], target=older))
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    assert [p.rows for p in engine_entry(load_bundle(bundle), "target").profiles] == \
        [(1, 1, 1)] * 2
    (bundle / "target.engine").write_bytes(b"x")
    assert not is_up_to_date(entry, plan, GPU, TRT_VERSION)


def test_failed_build_leaves_the_bundle_untouched(bundle, fake_trt, monkeypatch):
    files = snapshot(bundle)

    def fail_on_draft(trt, plan, out, cache):
        if plan.role == "draft":
            raise RuntimeError("TensorRT could not build the draft engine: out of memory")
        out.write_bytes(b"target engine")
        return []

    monkeypatch.setattr(trt_calls, "build_engine", fail_on_draft)
    with pytest.raises(RuntimeError, match="out of memory"):
        build_engines(bundle)
    assert snapshot(bundle) == files


def test_build_checks_the_gpu_before_building(bundle, fake_trt, monkeypatch):
    monkeypatch.setattr(trt_build, "gpu_identity", lambda: ("Jetson Xavier NX", (7, 2)))
    files = snapshot(bundle)
    with pytest.raises(ValueError, match="bf16 needs compute capability 8.0"):
        build_engines(bundle, precision="bf16")
    assert fake_trt == [] and snapshot(bundle) == files


def test_build_timing_cache_path(bundle, fake_trt, tmp_path):
    cache = tmp_path / "shared.cache"
    build_engines(bundle, timing_cache=cache)
    assert cache.read_bytes() == b"timing" and not (bundle / "timing.cache").exists()
    with pytest.raises(ValueError, match="--timing-cache"):
        build_engines(bundle, timing_cache=tmp_path / "no-such-folder" / "t.cache", force=True)


# ---- gpu_identity (cuda-python replaced by a fake) ------------------------------------------

def test_gpu_identity(monkeypatch):
    fake_cudart(monkeypatch)
    assert gpu_info.gpu_identity() == GPU
    with pytest.raises(ValueError, match="GPU 1 does not exist"):
        gpu_info.gpu_identity(1)


@pytest.mark.parametrize("count_error, count, words", [
    ("cudaErrorInsufficientDriver", None, "cudaGetDeviceCount failed with "
     "cudaErrorInsufficientDriver: check that the NVIDIA driver"),
    ("cudaSuccess", 0, "no CUDA GPU found"),
])
def test_gpu_identity_without_a_gpu(monkeypatch, count_error, count, words):
    fake_cudart(monkeypatch, count_error, count)
    with pytest.raises(BackendUnavailableError, match=words):
        gpu_info.gpu_identity()


def test_gpu_identity_without_cuda_python(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match="pip install cuda-python"):
        gpu_info.gpu_identity()


# ---- CLI without TensorRT -------------------------------------------------------------------

@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def test_cli_build_without_tensorrt(capsys, bundle, no_tensorrt):
    files = snapshot(bundle)
    code, out, err = call_main(capsys, "build", "--bundle", bundle)
    assert_one_line_error(code, err, "TensorRT is not installed: pip install tensorrt",
                          "JetPack", "ort-cpu")
    assert out == ""
    assert snapshot(bundle) == files


@pytest.mark.parametrize("args, words", [
    (["--precision", "int8"], ["needs an explicitly quantized graph"]),
    (["--precision", "fp4"], ["--precision", "invalid choice: 'fp4'"]),
    (["--max-prompt", "100000"], ["--max-prompt 100000 exceeds the context of 512"]),
    (["--max-draft-tokens", "0"], ["--max-draft-tokens must be an integer >= 1"]),
    (["--max-context", "4096"], ["--max-context 4096 exceeds"]),
])
def test_cli_build_bad_arguments(capsys, bundle, no_tensorrt, args, words):
    files = snapshot(bundle)
    code, out, err = call_main(capsys, "build", "--bundle", bundle, *args)
    assert_one_line_error(code, err, *words)
    assert out == "" and snapshot(bundle) == files


def test_cli_build_bad_bundle(capsys, tmp_path, no_tensorrt):
    code, _, err = call_main(capsys, "build", "--bundle", tmp_path / "nothing")
    assert_one_line_error(code, err, "nothing does not exist")
    (tmp_path / "empty").mkdir()
    code, _, err = call_main(capsys, "build", "--bundle", tmp_path / "empty")
    assert_one_line_error(code, err, "no manifest.json")
    code, _, err = call_main(capsys, "build")
    assert_one_line_error(code, err, "--bundle")


def test_cli_build_success_prints_one_json_line(capsys, bundle, fake_trt):
    code, out, err = call_main(capsys, "build", "--bundle", bundle, "--precision", "fp32")
    assert code == 0, err
    assert json.loads(out) == {"bundle": str(bundle), "precision": "fp32",
                               "engines": {"target": "target.engine", "draft": "draft.engine"},
                               "tensorrt_version": TRT_VERSION}


def test_cli_export_tensorrt_fails_before_exporting(capsys, tiny_checkpoints, tmp_path,
                                                    no_tensorrt, monkeypatch):
    from specedge.export import bundle_writer

    def no_export(*args, **kwargs):
        raise AssertionError("exported although TensorRT is missing")

    monkeypatch.setattr(bundle_writer, "write_bundle", no_export)
    out = tmp_path / "bundle"
    code, stdout, err = call_main(capsys, "export", tiny_checkpoints["llama"], "--out", out,
                                  "--backend", "tensorrt")
    assert_one_line_error(code, err, "TensorRT is not installed: pip install tensorrt")
    assert stdout == "" and not out.exists()
    code, stdout, err = call_main(capsys, "export", tiny_checkpoints["llama"], "--out", out,
                                  "--backend", "tensorrt", "--precision", "int8")
    assert_one_line_error(code, err, "--backend tensorrt needs --precision fp32 or fp16",
                          "MatMulNBits")
    assert not out.exists()


# ---- tensorrt/engine_calls.py against strict stand-ins for the TensorRT 10 and 11 bindings -------
# The stand-ins check what the real pybind11 bindings check (NVIDIA/TensorRT
# python/src/infer/pyCore.cpp, pyGraph.cpp, python/src/parsers/pyOnnx.cpp at v10.3.0 and
# v11.0): argument types and order (a wrong one is a TypeError), None / False where the C++
# API returns nullptr / false, and, for TensorRT 11, no removed name (reading or setting one is
# an AttributeError). They check our own logic (profiles fed in order, shape inputs, pins,
# flags, typing, files) against that reading of the API; they do not show that TensorRT
# behaves so: only a run on a CUDA machine does.

# BuilderFlag members that TensorRT 11.0's bindings no longer have (strong typing replaces
# them); TF32 stays.
REMOVED_IN_11 = ("FP16", "BF16", "INT8", "FP8", "INT4", "FP4", "OBEY_PRECISION_CONSTRAINTS",
                 "PREFER_PRECISION_CONSTRAINTS")
DataType = enum.IntEnum("DataType", "FLOAT HALF BF16 INT32 INT64 BOOL")
LayerType = enum.IntEnum("LayerType", "SOFTMAX NORMALIZATION CONSTANT SHAPE ASSERTION "
                                      "ELEMENTWISE CAST MATRIX_MULTIPLY")


def _expect(ok: bool, call: str) -> None:
    """pybind11's answer to arguments of the wrong type."""
    if not ok:
        raise TypeError(f"{call}: incompatible function arguments")


class _Tensor:
    __slots__ = ("name", "dtype", "is_shape_tensor")

    def __init__(self, name, dtype=DataType.FLOAT, shape_tensor=False):
        self.name, self.dtype, self.is_shape_tensor = name, dtype, shape_tensor


class _Layer11:
    """ILayer as TensorRT 11 binds it: no `precision`, no `set_output_type` (and __slots__,
    so setting one raises AttributeError as on a pybind11 object)."""

    __slots__ = ("name", "type", "outputs", "num_outputs")

    def __init__(self, name, kind, dtype=DataType.FLOAT):
        self.name, self.type = name, kind
        self.outputs, self.num_outputs = [_Tensor(name + "_out", dtype)], 1

    def get_output(self, j):
        return self.outputs[j]


class _Layer10(_Layer11):
    """TensorRT 10's ILayer: precision and output types may be set (weak typing)."""

    __slots__ = ("_precision", "output_types", "network")

    def __init__(self, name, kind, dtype=DataType.FLOAT):
        super().__init__(name, kind, dtype)
        self._precision, self.output_types, self.network = None, {}, None

    @property
    def precision(self):
        return self._precision

    @precision.setter
    def precision(self, dtype):
        _expect(isinstance(dtype, DataType), "ILayer.precision")
        self._precision = dtype
        self.network.typed_changes += 1

    def set_output_type(self, index, dtype):
        _expect(type(index) is int and isinstance(dtype, DataType), "set_output_type")
        self.output_types[index] = dtype
        self.network.typed_changes += 1


def fake_tensorrt(fail: str | None = None, shape_inputs=("logits_to_keep",),
                  version: str = TRT_VERSION, stale_cache: bytes | None = None):
    """A strict stand-in for the tensorrt module of `version` (10.x or 11.x).

    The parsed network's inputs and outputs are the ONNX graph's; its layers a fixed set that
    exercises the fp32 pins. `calls` records what the code asked for.
    """
    v11 = version.split(".")[0] == "11"
    Layer = _Layer11 if v11 else _Layer10
    calls: dict = {"flags": [], "cleared": [], "profiles": [], "cache_in": None,
                   "networks": [], "mismatch_args": []}
    layers = [Layer("/input_layernorm/Pow", LayerType.ELEMENTWISE),
              Layer("/input_layernorm/Constant", LayerType.CONSTANT),
              Layer("/norm/Shape", LayerType.SHAPE, dtype=DataType.INT64),
              Layer("/norm/Cast_to_int", LayerType.CAST, dtype=DataType.INT64),
              Layer("/Softmax", LayerType.SOFTMAX),
              Layer("/self_attn/MatMul", LayerType.MATRIX_MULTIPLY)]
    flag_names = ["DEBUG", "TF32", "REFIT"] + ([] if v11 else list(REMOVED_IN_11))
    BuilderFlag = enum.IntEnum("BuilderFlag", flag_names)
    # 10: EXPLICIT_BATCH (ignored) is bit 0, STRONGLY_TYPED bit 1; 11: STRONGLY_TYPED is bit 0
    # (deprecated, always on).
    CreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 0} if v11
                                else {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1})
    precision_flags = {getattr(BuilderFlag, n) for n in REMOVED_IN_11 if hasattr(BuilderFlag, n)}

    class ILogger:
        Severity = enum.IntEnum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE")

        def __init__(self):
            pass

    class IProgressMonitor:
        def __init__(self):
            pass

    class Network:
        def __init__(self, flags):
            self.strongly_typed = v11 or bool(flags & (1 << int(CreationFlag.STRONGLY_TYPED)))
            self.inputs, self.outputs, self.typed_changes = [], [], 0
            for layer in layers:
                if not v11:
                    layer.network = self

        @property
        def num_inputs(self):
            return len(self.inputs)

        @property
        def num_outputs(self):
            return len(self.outputs)

        @property
        def num_layers(self):
            return len(layers)

        def get_input(self, i):
            return self.inputs[i]

        def get_output(self, i):
            return self.outputs[i]

        def get_layer(self, i):
            return layers[i]

    class OnnxParser:
        num_errors = 1

        def __init__(self, network, logger):
            _expect(isinstance(network, Network) and isinstance(logger, ILogger),
                    "OnnxParser.__init__(network, logger)")
            self.network = network

        def parse_from_file(self, model):
            _expect(isinstance(model, str), "parse_from_file")
            calls["parsed"] = model
            if fail == "parse":
                return False
            graph = onnx.load(model, load_external_data=False).graph
            self.network.inputs = [_Tensor(t.name, DataType.INT64, t.name in shape_inputs)
                                   if t.name in ("input_ids", "position_ids", "past_length",
                                                 "logits_to_keep") else _Tensor(t.name)
                                   for t in graph.input]
            self.network.outputs = [_Tensor(t.name) for t in graph.output]
            return True

        def get_error(self, i):
            return "In node 7 (Foo): UNSUPPORTED_NODE"

    class Profile:
        def __init__(self):
            self.shapes, self.values = {}, {}

        @staticmethod
        def _check(call, name, *dims):
            _expect(isinstance(name, str) and all(
                isinstance(d, tuple) and all(type(x) is int for x in d) for d in dims), call)

        def set_shape(self, input, min, opt, max):  # the bindings' argument names
            self._check("set_shape", input, min, opt, max)
            self.shapes[input] = (min, opt, max)

        def set_shape_input(self, input, min, opt, max):
            self._check("set_shape_input", input, min, opt, max)
            self.values[input] = (min, opt, max)

    class ITimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return memoryview(b"cache v2")

    class Config:
        def __init__(self):
            self._monitor, self.cache, self.profiles = None, None, []

        @property
        def progress_monitor(self):
            return self._monitor

        @progress_monitor.setter
        def progress_monitor(self, monitor):
            _expect(isinstance(monitor, IProgressMonitor), "progress_monitor")
            self._monitor = monitor

        def set_flag(self, flag):
            _expect(isinstance(flag, BuilderFlag), "set_flag")
            calls["flags"].append(flag.name)

        def clear_flag(self, flag):
            _expect(isinstance(flag, BuilderFlag), "clear_flag")
            calls["cleared"].append(flag.name)

        def add_optimization_profile(self, profile):
            _expect(isinstance(profile, Profile), "add_optimization_profile")
            calls["profiles"].append(profile)
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, serialized_timing_cache):
            _expect(isinstance(serialized_timing_cache, (bytes, bytearray, memoryview)),
                    "create_timing_cache")
            if serialized_timing_cache:
                calls["cache_in"] = bytes(serialized_timing_cache)
            return ITimingCache(serialized_timing_cache)

        def set_timing_cache(self, cache, ignore_mismatch):
            _expect(isinstance(cache, ITimingCache) and type(ignore_mismatch) is bool,
                    "set_timing_cache(cache, ignore_mismatch: bool)")
            calls["mismatch_args"].append(ignore_mismatch)
            if cache.data and cache.data == stale_cache and not ignore_mismatch:
                return False  # a cache from another GPU or TensorRT version
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            _expect(isinstance(logger, ILogger), "Builder(logger)")
            self.logger = logger

        def create_network(self, flags=0):
            _expect(type(flags) is int, "create_network(flags: int)")
            network = Network(flags)
            calls["networks"].append(network)
            return network

        def create_builder_config(self):
            self.config = Config()
            return self.config

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            _expect(isinstance(network, Network) and isinstance(config, Config),
                    "build_serialized_network(network, config)")
            m = config.progress_monitor
            m.phase_start("Building engine", None, 2)
            m.phase_start("Tactic search", "Building engine", 3)
            for step in range(3):
                assert m.step_complete("Tactic search", step)
            m.phase_finish("Tactic search")
            m.phase_finish("Building engine")
            self.logger.log(ILogger.Severity.WARNING, "a warning")
            # TensorRT 10 refuses precision flags and layer types on a strongly typed network.
            typed_misuse = network.strongly_typed and (
                precision_flags & {getattr(BuilderFlag, f) for f in calls["flags"]}
                or network.typed_changes)
            if fail == "build" or typed_misuse:
                self.logger.log(ILogger.Severity.ERROR, "out of device memory" if fail
                                else "precision flags on a strongly typed network")
                return None  # IBuilder::buildSerializedNetwork returns nullptr
            return memoryview(b"serialized engine")

    trt = types.ModuleType("tensorrt")
    trt.__dict__.update(
        __version__=version, ILogger=ILogger, IProgressMonitor=IProgressMonitor,
        Builder=Builder, OnnxParser=OnnxParser, float32=DataType.FLOAT,
        float16=DataType.HALF, bfloat16=DataType.BF16, LayerType=LayerType,
        BuilderFlag=BuilderFlag, NetworkDefinitionCreationFlag=CreationFlag)
    return trt, calls, layers


def build_one(trt, plan, tmp_path, cache=None):
    return trt_calls.build_engine(trt, plan, tmp_path / "e", cache or tmp_path / "timing.cache")


def test_trt_calls_control_flow(tiny_bundle, tmp_path):
    plan = plan_builds(load_bundle(tiny_bundle))[0]
    trt, calls, layers = fake_tensorrt()
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"cache v1")
    out = tmp_path / "target.engine.tmp"
    assert trt_calls.build_engine(trt, plan, out, cache) == ["logits_to_keep"]
    assert out.read_bytes() == b"serialized engine"
    assert calls["parsed"] == str(plan.onnx)
    assert [n.strongly_typed for n in calls["networks"]] == [False]
    assert calls["cache_in"] == b"cache v1" and cache.read_bytes() == b"cache v2"
    assert calls["mismatch_args"] == [False]  # a cache from elsewhere is rejected, not used
    assert calls["flags"] == ["FP16", "PREFER_PRECISION_CONSTRAINTS"] and not calls["cleared"]
    prefill, decode = calls["profiles"]
    assert prefill.values == {"logits_to_keep": ((1,), (1,), (1,))}
    assert decode.values == {"logits_to_keep": ((1,), (9,), (9,))}
    assert "logits_to_keep" not in prefill.shapes
    assert prefill.shapes["input_ids"] == ((1, 1), (1, 256), (1, 512))
    assert decode.shapes["past_key_values.1.value"] == ((1, 2, 256, 8), (1, 2, 512, 8),
                                                         (1, 2, 512, 8))
    pinned = {layer.name for layer in layers if layer.precision == DataType.FLOAT}
    assert pinned == {"/input_layernorm/Pow", "/Softmax"}
    assert all(layer.output_types == {0: DataType.FLOAT} for layer in layers
               if layer.name in pinned)


def test_trt_calls_fp32_clears_tf32_and_pins_nothing(tiny_bundle, tmp_path):
    plan = plan_builds(load_bundle(tiny_bundle), "fp32")[1]
    trt, calls, layers = fake_tensorrt()
    build_one(trt, plan, tmp_path)
    assert calls["flags"] == [] and calls["cleared"] == ["TF32"]
    assert all(layer.precision is None for layer in layers)
    assert calls["cache_in"] is None  # no cache file yet: an empty one


def test_trt_calls_stale_timing_cache_is_replaced(tiny_bundle, tmp_path, capsys):
    plan = plan_builds(load_bundle(tiny_bundle))[0]
    trt, calls, _ = fake_tensorrt(stale_cache=b"from another GPU")
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"from another GPU")
    build_one(trt, plan, tmp_path, cache)
    assert "ignoring timing cache" in capsys.readouterr().err
    assert calls["mismatch_args"] == [False, False]  # rejected, then a fresh one set
    assert cache.read_bytes() == b"cache v2"


@pytest.mark.parametrize("version", ["11.0.0.12", "11.1.0"])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_trt_calls_tensorrt_11_strongly_typed(tiny_bundle, tmp_path, version, precision):
    """TensorRT 11: a strongly typed network, no precision flag, no pin; the graph decides."""
    plan = replace(plan_builds(load_bundle(tiny_bundle), precision)[0],
                   graph_precision=precision)
    trt, calls, layers = fake_tensorrt(version=version)
    assert build_one(trt, plan, tmp_path) == ["logits_to_keep"]
    assert (tmp_path / "e").read_bytes() == b"serialized engine"
    assert [n.strongly_typed for n in calls["networks"]] == [True]
    assert calls["flags"] == []
    assert calls["cleared"] == (["TF32"] if precision == "fp32" else [])
    assert len(calls["profiles"]) == 2


def test_tensorrt_11_stand_in_lacks_the_removed_api():
    """The stand-in is as strict as TensorRT 11's bindings: what is gone raises."""
    trt, _, layers = fake_tensorrt(version="11.0.0")
    for name in REMOVED_IN_11:
        with pytest.raises(AttributeError):
            getattr(trt.BuilderFlag, name)
    assert trt.BuilderFlag.TF32 is not None
    with pytest.raises(AttributeError):
        layers[0].precision = trt.float32
    with pytest.raises(AttributeError):
        layers[0].set_output_type(0, trt.float32)
    trt10, _, layers10 = fake_tensorrt(version="10.16.0")
    assert all(hasattr(trt10.BuilderFlag, name) for name in REMOVED_IN_11)


def test_tensorrt_10_stand_in_rejects_flags_on_a_strongly_typed_network(tiny_bundle,
                                                                        tmp_path,
                                                                        monkeypatch):
    """As TensorRT 10 does: typing and flags must come from the one decision in plan.py."""
    plan = plan_builds(load_bundle(tiny_bundle))[0]
    trt, calls, _ = fake_tensorrt()
    monkeypatch.setattr(trt_calls, "strongly_typed", lambda version: True)
    monkeypatch.setattr(trt_calls, "builder_flags", lambda precision, strong: (("FP16",), ()))
    with pytest.raises(RuntimeError, match="could not build.*strongly typed network"):
        build_one(trt, plan, tmp_path)
    assert [n.strongly_typed for n in calls["networks"]] == [True]  # bit 1 on TensorRT 10


def test_tensorrt_11_without_the_deprecated_typing_flag(tiny_bundle, tmp_path):
    """STRONGLY_TYPED is deprecated in 11.0 (always on): a release without it still builds."""
    plan = replace(plan_builds(load_bundle(tiny_bundle))[0], graph_precision="fp16")
    trt, calls, _ = fake_tensorrt(version="11.2.0")
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag",
                                                     "PREFER_AOT_PYTHON_PLUGINS")
    build_one(trt, plan, tmp_path)
    assert (tmp_path / "e").read_bytes() == b"serialized engine" and calls["flags"] == []


@pytest.mark.parametrize("weak_on_11", ["flags", "pins"])
def test_trt_calls_unknown_api_is_one_clear_error(tiny_bundle, tmp_path, monkeypatch,
                                                 weak_on_11):
    """A TensorRT API the code does not know (here: the weak-typing path run on TensorRT 11)
    is a RuntimeError saying what to install, not an AttributeError."""
    plan = plan_builds(load_bundle(tiny_bundle))[0]
    trt, _, _ = fake_tensorrt(version="11.0.0")
    if weak_on_11 == "flags":
        monkeypatch.setattr(trt_calls, "strongly_typed", lambda version: False)
    else:  # no flags asked, but fp32 pins on layers that have no `precision` in TensorRT 11
        monkeypatch.setattr(trt_calls, "strongly_typed", lambda version: False)
        monkeypatch.setattr(trt_calls, "builder_flags", lambda precision, strong: ((), ()))
    with pytest.raises(RuntimeError) as e:
        build_one(trt, plan, tmp_path)
    message = str(e.value)
    assert "the Python API of TensorRT 11.0.0 is not the one specedge build knows" in message
    assert "AttributeError" in message and "pip install 'tensorrt>=10,<12'" in message
    assert "\n" not in message and isinstance(e.value.__cause__, AttributeError)


@pytest.mark.parametrize("fail, words", [
    ("parse", "TensorRT cannot parse .*target.onnx: In node 7 \\(Foo\\): UNSUPPORTED_NODE"),
    ("build", "could not build the target engine: out of device memory"),
])
@pytest.mark.parametrize("version", [TRT_VERSION, "11.0.0"])
def test_trt_calls_failures(tiny_bundle, tmp_path, fail, words, version):
    """build_serialized_network returns None on failure: a clear error and no engine file."""
    plan = replace(plan_builds(load_bundle(tiny_bundle))[0], graph_precision="fp16")
    trt, _, _ = fake_tensorrt(fail=fail, version=version)
    with pytest.raises(RuntimeError, match=words):
        build_one(trt, plan, tmp_path)
    assert not (tmp_path / "e").exists()


def test_trt_calls_unexpected_shape_input(tiny_bundle, tmp_path):
    plan = plan_builds(load_bundle(tiny_bundle))[0]
    trt, _, _ = fake_tensorrt(shape_inputs=("position_ids",))
    with pytest.raises(RuntimeError, match="'position_ids' as a shape tensor"):
        build_one(trt, plan, tmp_path)


# ---- TensorRT versions and precision at `specedge build` ------------------------------------

@pytest.mark.parametrize("version, major", [("10.0.1.6", 10), ("10.3.0.30", 10),
                                            ("10.16.0", 10), ("11.0.0.12", 11), ("11.1", 11)])
def test_supported_tensorrt_versions(version, major):
    assert tensorrt_major(version) == major
    assert strongly_typed(version) == (major == 11)


@pytest.mark.parametrize("version", ["8.6.2", "9.3.0", "12.0.0", "", "abc", None, "1O.3"])
def test_unsupported_tensorrt_version_is_one_clear_error(version):
    with pytest.raises(BackendUnavailableError) as e:
        tensorrt_major(version)
    message = str(e.value)
    assert message.startswith(f"TensorRT {version} is not supported: specedge supports "
                              "TensorRT 10.x and 11.x; pip install 'tensorrt>=10,<12'")
    assert "JetPack 6.1" in message and "\n" not in message
    with pytest.raises(BackendUnavailableError):
        strongly_typed(version)


def test_builder_flags_strongly_typed():
    for precision in ("fp16", "bf16", "int8", "fp8"):
        assert builder_flags(precision, strong=True) == ((), ())
    assert builder_flags("fp32", strong=True) == ((), ("TF32",))
    assert builder_flags("fp16", strong=False) == builder_flags("fp16")


def test_plan_records_the_graph_precision(tiny_bundle):
    assert [p.graph_precision for p in plan_builds(load_bundle(tiny_bundle))] == ["fp32", "fp32"]


GRAPH_PRECISION_CASES = [
    ("fp16", "fp32", "target.onnx is fp32: build with --precision fp32, or re-export the bundle "
     "with `specedge export MODEL --precision fp16` for an fp16 engine"),
    ("fp32", "fp16", "target.onnx is fp16: build with --precision fp16, or re-export the bundle "
     "with `specedge export MODEL --precision fp32` for an fp32 engine"),
    ("bf16", "fp16", "build with --precision fp16, or specedge export writes no bf16 graphs"),
    ("fp16", None, "the manifest does not say which float precision target.onnx holds"),
]


@pytest.mark.parametrize("asked, graph, words", GRAPH_PRECISION_CASES)
def test_graph_precision_on_tensorrt_11(tiny_bundle, asked, graph, words):
    plan = replace(plan_builds(load_bundle(tiny_bundle), "fp32")[0], precision=asked,
                   graph_precision=graph)
    check_graph_precision(plan, "10.3.0")  # TensorRT 10 converts with flags: any graph
    with pytest.raises(ValueError) as e:
        check_graph_precision(plan, "11.0.0")
    assert "TensorRT 11.0.0 takes the engine's precision from the graph's types" in str(e.value)
    assert words in str(e.value)


def test_graph_precision_on_tensorrt_11_accepts(tiny_bundle):
    plan = plan_builds(load_bundle(tiny_bundle), "fp32")[0]
    check_graph_precision(plan, "11.0.0")
    check_graph_precision(replace(plan, precision="fp16", graph_precision="fp16"), "11.0.0")
    check_graph_precision(replace(plan, precision="int8"), "11.0.0")  # Q/DQ set it


def set_graph_precision(bundle: Path, precision: str) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    for model in manifest["models"].values():
        model["precision"] = precision
    (bundle / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def strict_trt(monkeypatch):
    """`specedge build` on this machine with TensorRT replaced by a strict stand-in of the
    version `use(version)` selects; engine_calls.py runs for real against it."""
    monkeypatch.setattr(trt_build, "gpu_identity", lambda: GPU)
    chosen = {}

    def use(version: str, **kwargs):
        trt, calls, _ = fake_tensorrt(version=version, **kwargs)
        monkeypatch.setattr(trt_build, "import_tensorrt", lambda: trt)
        chosen["calls"] = calls
        return trt, calls

    return use


@pytest.mark.parametrize("version", ["8.6.2", "12.0.0"])
def test_preflight_checks_the_tensorrt_version(strict_trt, version):
    """Checked at preflight, so `specedge export --backend tensorrt` fails before exporting."""
    strict_trt(version)
    with pytest.raises(BackendUnavailableError, match=r"not supported: specedge supports "
                       r"TensorRT 10\.x and 11\.x"):
        trt_build.preflight("fp32")
    strict_trt("11.0.0")
    assert trt_build.preflight("fp32")[1] == GPU


@pytest.mark.parametrize("version", ["8.6.2", "12.0.0"])
def test_cli_build_unsupported_tensorrt(capsys, bundle, strict_trt, version):
    strict_trt(version)
    files = snapshot(bundle)
    code, out, err = call_main(capsys, "build", "--bundle", bundle)
    assert_one_line_error(code, err, f"TensorRT {version} is not supported",
                          "TensorRT 10.x and 11.x", "pip install 'tensorrt>=10,<12'")
    assert out == "" and snapshot(bundle) == files


def test_cli_build_tensorrt_11_fp16_needs_an_fp16_graph(capsys, bundle, strict_trt):
    _, calls = strict_trt("11.0.0")
    files = snapshot(bundle)
    code, out, err = call_main(capsys, "build", "--bundle", bundle)  # default fp16, fp32 graph
    assert_one_line_error(code, err, "target.onnx is fp32: build with --precision fp32",
                          "specedge export MODEL --precision fp16")
    assert out == "" and snapshot(bundle) == files and calls["networks"] == []


@pytest.mark.parametrize("version, precision, graph", [
    ("11.0.0", "fp32", "fp32"), ("11.1.0", "fp16", "fp16"), ("10.3.0", "fp16", "fp32"),
    ("10.16.1", "bf16", "fp32")])
def test_cli_build_with_strict_tensorrt(capsys, bundle, strict_trt, version, precision,
                                        graph):
    """The whole build, engine_calls.py included, against the stand-in of each major version."""
    set_graph_precision(bundle, graph)
    _, calls = strict_trt(version)
    code, out, err = call_main(capsys, "build", "--bundle", bundle, "--precision", precision)
    assert code == 0, err
    assert json.loads(out)["tensorrt_version"] == version
    assert [n.strongly_typed for n in calls["networks"]] == [version.startswith("11")] * 2
    assert (bundle / "draft.engine").read_bytes() == b"serialized engine"
    entry = engine_entry(load_bundle(bundle), "target")
    assert entry.precision == precision and entry.tensorrt_version == version


def test_cli_build_unknown_tensorrt_api_is_one_line(capsys, bundle, strict_trt, monkeypatch):
    trt, _ = strict_trt("11.0.0")
    set_graph_precision(bundle, "fp16")
    del trt.OnnxParser  # a TensorRT without the ONNX parser the build needs
    files = snapshot(bundle)
    code, out, err = call_main(capsys, "build", "--bundle", bundle)
    assert "Traceback" not in err and code == 2 and out == ""
    *progress, last = err.strip().splitlines()
    assert all(line.startswith("build target") for line in progress), err
    assert last.startswith("specedge") and "error" in last
    for words in ("the Python API of TensorRT 11.0.0 is not the one specedge build knows",
                  "OnnxParser", "pip install 'tensorrt>=10,<12'"):
        assert words in last, last
    assert snapshot(bundle) == files


@pytest.mark.parametrize("version,precision,engines", [("10.3.0", "fp32", "fp16"),
                                                       ("11.0.0", "fp32", "fp32"),
                                                       ("11.0.0", "fp16", "fp16")])
def test_cli_export_tensorrt_builds_what_the_tensorrt_can(capsys, tiny_checkpoints, tmp_path,
                                                          fake_trt, monkeypatch, version,
                                                          precision, engines):
    """`export --backend tensorrt` builds fp16 engines where the precision is a builder flag
    (TensorRT 10) and engines of the export's own precision where the graph's types set it
    (TensorRT 11), instead of failing after the export."""
    monkeypatch.setattr(trt_build, "import_tensorrt",
                        lambda: types.SimpleNamespace(__version__=version))
    out = tmp_path / "bundle"
    code, stdout, err = call_main(capsys, "export", tiny_checkpoints["llama"], "--out", out,
                                  "--draft-layers", 1, "--backend", "tensorrt",
                                  "--precision", precision)
    assert code == 0, err
    assert json.loads(stdout)["engines"] == {"target": "target.engine", "draft": "draft.engine"}
    assert [p.precision for p in fake_trt] == [engines, engines]
    assert (out / "target.engine").read_bytes() == f"target {engines} engine".encode()


def test_serving_a_batch_on_engines_built_for_one_sequence_says_how_to_rebuild(bundle, capsys):
    """`specedge serve --backend tensorrt --max-batch 2` checks the engines' rows before
    loading anything: exit 2, one line naming the rebuild."""
    from specedge.serve.app import ServerSettings
    from specedge.serve.cli import check_batchable

    fake_engines(bundle)
    settings = ServerSettings(bundle=str(bundle), backend="tensorrt", max_batch=2)
    with pytest.raises(SystemExit) as e:
        check_batchable(settings, load_bundle(bundle))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"specedge build --bundle {bundle} --max-batch 2 --force`" in err
    check_batchable(replace(settings, max_batch=1), load_bundle(bundle))  # nothing to check
