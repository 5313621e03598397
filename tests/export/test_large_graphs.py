"""Graphs over protobuf's 2 GB limit: weights in a data file beside the graph, written and
quantized one tensor at a time, and checked when a bundle is loaded.

A tiny model stands in for a large one by lowering the size above which a graph gets a data
file (`onnx_files.INLINE_LIMIT`): the code path is the one a 1B-parameter model takes.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specedge.export import onnx_files
from specedge.export.bundle_writer import export_bundle
from specedge.runtime import Generator
from specedge.runtime.bundle import load_bundle
from specedge.runtime.errors import BundleError


def _graph(weight: np.ndarray, bias: np.ndarray, constant: np.ndarray) -> onnx.ModelProto:
    """y = x @ weight + bias + constant, the last a Constant node's attribute tensor."""
    k, n = weight.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["xw"]),
         onnx.helper.make_node("Add", ["xw", "b"], ["xwb"]),
         onnx.helper.make_node("Constant", [], ["c"],
                               value=onnx.numpy_helper.from_array(constant, "c")),
         onnx.helper.make_node("Add", ["xwb", "c"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, n])],
        [onnx.numpy_helper.from_array(weight, "w"), onnx.numpy_helper.from_array(bias, "b")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)],
                                  ir_version=10)


def test_save_graph_gathers_tensor_files_into_one_aligned_data_file(tmp_path, monkeypatch):
    """As torch writes a graph over 2 GB: one file per tensor, Constant values included.
    `save_graph` reads them one at a time into one data file; small tensors stay inline."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(64, 48)).astype(np.float32)
    bias = rng.normal(size=(48,)).astype(np.float32)  # 192 bytes: stays in the graph
    constant = rng.normal(size=(2, 48)).astype(np.float32)  # 384 bytes
    source = tmp_path / "traced"
    source.mkdir()
    onnx.save_model(_graph(weight, bias, constant), str(source / "g.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0, convert_attribute=True)
    assert len(list(source.iterdir())) == 4  # the graph and a file per tensor
    monkeypatch.setattr(onnx_files, "INLINE_LIMIT", 0)
    monkeypatch.setattr(onnx_files, "SMALL_TENSOR", 300)
    path = tmp_path / "g.onnx"
    onnx_files.save_graph(onnx_files.load_graph(source / "g.onnx"), source, path)
    assert onnx_files.graph_files(path) == [path, tmp_path / "g.onnx.data"]
    model = onnx_files.load_graph(path)
    tensors = {t.name: t for t in onnx_files.all_tensors(model)}
    assert [name for name, t in tensors.items() if onnx_files.is_external(t)] == ["w", "c"]
    for name in ("w", "c"):
        offset = int({e.key: e.value for e in tensors[name].external_data}["offset"])
        assert offset % onnx_files.ALIGNMENT == 0
    np.testing.assert_array_equal(onnx_files.load_array(tensors["w"], tmp_path), weight)
    x = rng.normal(size=(2, 64)).astype(np.float32)
    expected = x @ weight + bias + constant
    (y,) = ort.InferenceSession(str(path)).run(None, {"x": x})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # and back to one file when the tensors fit
    monkeypatch.setattr(onnx_files, "INLINE_LIMIT", 1 << 30)
    onnx_files.save_graph(onnx_files.load_graph(path), tmp_path, tmp_path / "one.onnx")
    assert onnx_files.graph_files(tmp_path / "one.onnx") == [tmp_path / "one.onnx"]
    (y1,) = ort.InferenceSession(str(tmp_path / "one.onnx")).run(None, {"x": x})
    np.testing.assert_array_equal(y, y1)


@pytest.fixture(scope="module")
def split_and_whole(tiny_checkpoints, tmp_path_factory):
    """The same int4 export, once with data files and once as single files."""
    root = tmp_path_factory.mktemp("large")
    whole = root / "whole"
    export_bundle(str(tiny_checkpoints["llama"]), whole, draft_layers=1, precision="int4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_files, "INLINE_LIMIT", 0)
        split = root / "split"
        export_bundle(str(tiny_checkpoints["llama"]), split, draft_layers=1, precision="int4",
                      verify=True)
    return split, whole


def test_a_bundle_with_data_files_decodes_as_one_without(split_and_whole):
    split, whole = split_and_whole
    manifest = json.loads((split / "manifest.json").read_text())
    for role in ("target", "draft"):
        entry = manifest["models"][role]
        assert entry["data_file"] == f"{role}.onnx.data"
        assert entry["data_file_size"] == (split / entry["data_file"]).stat().st_size > 0
    # the fp32 graphs the quantize step read are gone
    assert sorted(p.name for p in split.glob("*.onnx*")) == [
        "draft.onnx", "draft.onnx.data", "target.onnx", "target.onnx.data"]
    assert not list(whole.glob("*.data"))
    prompt = "The quick brown fox"
    a = Generator.from_bundle(split).generate(prompt, max_new_tokens=24, temperature=0)
    b = Generator.from_bundle(whole).generate(prompt, max_new_tokens=24, temperature=0)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_the_manifest_records_each_export_step(split_and_whole):
    steps = json.loads((split_and_whole[0] / "manifest.json").read_text())["export_steps"]
    assert [s["step"] for s in steps] == ["load models", "export target graph",
                                          "export draft graph", "verify graphs", "quantize"]
    for s in steps:
        assert s["seconds"] >= 0
        assert s["peak_rss_mb"] is None or s["peak_rss_mb"] > 10  # a Python process with torch


def test_a_truncated_data_file_is_refused_at_load(split_and_whole, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(split_and_whole[0], bundle)
    data = bundle / "target.onnx.data"
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(BundleError, match="target.onnx.data is .* bytes, the manifest says"):
        load_bundle(bundle)
    data.unlink()
    with pytest.raises(BundleError, match="bundle file missing: .*target.onnx.data"):
        load_bundle(bundle)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_truncated_draft_copies_only_its_own_layers(arch, tiny_checkpoints, monkeypatch):
    """Only the kept layers are copied (a 1B target's other layers are 4 GB of fp32); the
    target is left whole and shares no tensor with its draft."""
    import copy

    from transformers import AutoModelForCausalLM

    from specedge.export.drafts import truncated

    target = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch]).eval()
    total = sum(p.numel() for p in target.parameters())
    copied, real = [], copy.deepcopy

    def counting_deepcopy(obj, *args):  # the copy module's own, so count the model only
        if obj is target:
            copied.append(sum(p.numel() for p in obj.parameters()))
        return real(obj, *args)

    monkeypatch.setattr(truncated.copy, "deepcopy", counting_deepcopy)
    draft = truncated.truncated_draft(target, 1)
    monkeypatch.undo()
    kept = sum(p.numel() for p in draft.parameters())
    assert copied == [kept] and kept < total
    assert sum(p.numel() for p in target.parameters()) == total
    assert truncated.num_layers(target.config) == 2 and truncated.num_layers(draft.config) == 1
    ours = {p.data_ptr() for p in target.parameters()}
    assert not ours & {p.data_ptr() for p in draft.parameters()}
