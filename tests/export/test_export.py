"""Export: every supported architecture matches transformers; bundles are atomic and cached."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import ARCHITECTURES, save_tiny
from transformers import AutoModelForCausalLM

from specedge.export import bundle_writer
from specedge.export.bundle_writer import export_bundle
from specedge.export.verify import verify_graph
from specedge.runtime.bundle import graph_io, load_bundle


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture_matches_transformers(arch, tiny_checkpoints, tmp_path):
    manifest = export_bundle(str(tiny_checkpoints[arch]), tmp_path / arch, draft_layers=1,
                             verify=True)
    for role in ("target", "draft"):
        report = manifest["verify"][role]
        assert report["ok"], report
        assert report["max_abs_logit_diff"] < 1e-4
        assert report["greedy_matches"] == report["greedy_steps"] == 32
    assert manifest["models"]["target"]["architecture"] == arch
    assert manifest["models"]["draft"]["num_layers"] == 1


def test_verify_detects_a_wrong_graph(tiny_checkpoints, tmp_path):
    """--verify has teeth: a graph exported from other weights fails it."""
    other = save_tiny(tmp_path / "other", "llama", seed=1)
    export_bundle(str(other), tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    report = verify_graph(model, tmp_path / "b" / "target.onnx", [1, 5, 6, 7])
    assert not report["ok"]
    assert report["max_abs_logit_diff"] > 1e-2


def test_manifest_records_the_contract(tiny_bundle):
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    target = manifest["models"]["target"]
    inputs, outputs = graph_io(target["num_layers"])
    assert [i["name"] for i in target["inputs"]] == inputs
    assert [o["name"] for o in target["outputs"]] == outputs
    assert target["inputs"][4]["shape"] == [1, target["num_kv_heads"], "C", target["head_dim"]]
    assert target["outputs"][1]["shape"] == [1, target["num_kv_heads"], "T",
                                             target["head_dim"]]
    assert target["kv_layout"] == "bhsd-fixed"
    assert manifest["tokenizer"]["eos_token_ids"] == [2]
    assert manifest["versions"]["torch"].startswith("2.13")
    bundle = load_bundle(tiny_bundle)
    assert bundle.chat_template and bundle.draft.vocab_size == bundle.target.vocab_size


def test_up_to_date_bundle_is_not_redone(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "b"
    export_bundle(str(tiny_checkpoints["gpt2"]), out)
    mtime = (out / "target.onnx").stat().st_mtime_ns
    export_bundle(str(tiny_checkpoints["gpt2"]), out)
    assert "up to date" in capsys.readouterr().err
    assert (out / "target.onnx").stat().st_mtime_ns == mtime
    export_bundle(str(tiny_checkpoints["gpt2"]), out, force=True)
    assert (out / "target.onnx").stat().st_mtime_ns != mtime


def test_changed_checkpoint_is_re_exported(tiny_checkpoints, tmp_path, capsys):
    import shutil

    source = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["gpt2"], source)
    out = tmp_path / "b"
    export_bundle(str(source), out)
    mtime = (out / "target.onnx").stat().st_mtime_ns
    save_tiny(source, "gpt2", seed=3)  # same path, new weights
    export_bundle(str(source), out)
    assert "up to date" not in capsys.readouterr().err
    assert (out / "target.onnx").stat().st_mtime_ns != mtime


def test_interrupted_export_leaves_nothing(tiny_checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "b"
    real = bundle_writer.export_onnx
    calls = []

    def fail_on_draft(model, path, **kwargs):
        calls.append(path)
        if path.endswith("draft.onnx"):
            raise KeyboardInterrupt
        real(model, path, **kwargs)

    monkeypatch.setattr(bundle_writer, "export_onnx", fail_on_draft)
    with pytest.raises(KeyboardInterrupt):
        export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_interrupted_reexport_keeps_the_old_bundle(tiny_checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "b"
    export_bundle(str(tiny_checkpoints["llama"]), out)
    before = (out / "manifest.json").read_text()

    def boom(model, path, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(bundle_writer, "export_onnx", boom)
    with pytest.raises(RuntimeError):
        export_bundle(str(tiny_checkpoints["llama"]), out, force=True)
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_graph_returns_only_the_new_rows(tiny_bundle):
    """present.* holds T rows whatever the cache capacity: no concat(past, new) output."""
    import onnxruntime as ort

    spec = load_bundle(tiny_bundle).target
    session = ort.InferenceSession(str(spec.path))
    inputs, _ = graph_io(spec.num_layers)
    feeds = {"input_ids": np.array([[5, 6]]), "position_ids": np.array([[3, 4]]),
             "past_length": np.array([3]), "logits_to_keep": np.array([2])}
    for name in inputs[4:]:
        feeds[name] = np.zeros((1, spec.num_kv_heads, 100, spec.head_dim), np.float32)
    logits, *presents = session.run(None, feeds)
    assert logits.shape == (1, 2, spec.vocab_size)
    assert all(p.shape == (1, spec.num_kv_heads, 2, spec.head_dim) for p in presents)


def test_layers_add_no_shape_arithmetic_and_one_projection_per_input(tmp_path):
    """Each Llama layer adds the same ops whatever the depth: no Shape op (sizes are
    constants; the mask and rotary tables are built once per call), and four weight
    products (q/k/v fused, o, gate/up fused, down)."""
    from collections import Counter

    import onnx

    counts = {}
    for layers in (2, 4):
        ckpt = save_tiny(tmp_path / f"ckpt{layers}", "llama", layers=layers)
        export_bundle(str(ckpt), tmp_path / f"b{layers}")
        graph = onnx.load(str(tmp_path / f"b{layers}" / "target.onnx")).graph
        weights = {i.name for i in graph.initializer}
        ops = Counter(n.op_type for n in graph.node)
        ops["weight product"] = sum(n.op_type in ("MatMul", "Gemm") and n.input[1] in weights
                                    for n in graph.node)
        counts[layers] = ops
    per_layer = {op: (counts[4][op] - counts[2][op]) / 2 for op in counts[4]}
    assert per_layer["Shape"] == 0, per_layer
    assert per_layer["weight product"] == 4, per_layer


def test_bundle_from_an_older_exporter_is_re_exported(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "b"
    export_bundle(str(tiny_checkpoints["gpt2"]), out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"]["graph_revision"] -= 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    export_bundle(str(tiny_checkpoints["gpt2"]), out)
    assert "up to date" not in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["source"]["graph_revision"] == \
        manifest["source"]["graph_revision"] + 1
