"""Export: every supported architecture matches transformers; bundles are atomic and cached."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from tiny_models import ARCHITECTURES, char_tokenizer, save_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from specedge.cli import main
from specedge.export import bundle_writer
from specedge.export.bundle_writer import VERIFY_PROMPT, export_bundle
from specedge.export.verify import verify_graph
from specedge.runtime import Generator
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
    assert target["inputs"][0]["shape"] == ["B", "T"]
    assert target["inputs"][4]["shape"] == ["B", target["num_kv_heads"], "C",
                                            target["head_dim"]]
    assert target["outputs"][1]["shape"] == ["B", target["num_kv_heads"], "T",
                                             target["head_dim"]]
    assert target["kv_layout"] == "bhsd-fixed"
    assert target["batch_rows"] is True and manifest["format_version"] == 4
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
        if path.name == "draft.onnx":
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


# ---- draft compatibility by tokenizer ----------------------------------------------------

def test_draft_with_a_larger_padded_embedding_is_fitted_and_masked(tmp_path):
    """Checkpoints pad their embeddings differently (Qwen2.5's sizes): a draft with the
    target's tokenizer and a larger embedding (48 rows against the target's 40, the
    tokenizer's 34 ids) is accepted; its graph outputs the target's 40 logits, -inf for the
    ids beyond the tokenizer, and speculative decoding equals plain."""
    target = save_tiny(tmp_path / "target", "llama", vocab_size=40)
    # the target itself with 8 more padding rows: its drafts are often right
    draft = AutoModelForCausalLM.from_pretrained(target)
    draft.resize_token_embeddings(48, mean_resizing=False)
    draft.save_pretrained(tmp_path / "draft")
    char_tokenizer().save_pretrained(tmp_path / "draft")
    draft = tmp_path / "draft"
    out = tmp_path / "b"
    manifest = export_bundle(str(target), out, draft=str(draft), verify=True)
    assert manifest["verify"]["draft"]["ok"], manifest["verify"]
    assert manifest["models"]["draft"]["vocab_size"] == 40
    bundle = load_bundle(out)
    session = ort.InferenceSession(str(bundle.draft.path))
    inputs, _ = graph_io(bundle.draft.num_layers)
    feeds = {"input_ids": np.array([[5, 6, 7]]), "position_ids": np.array([[0, 1, 2]]),
             "past_length": np.array([0]), "logits_to_keep": np.array([3])}
    for name in inputs[4:]:
        feeds[name] = np.zeros((1, bundle.draft.num_kv_heads, 4, bundle.draft.head_dim),
                               np.float32)
    logits = session.run(None, feeds)[0][0]
    assert logits.shape == (3, 40)
    assert np.isneginf(logits[:, 34:]).all() and np.isfinite(logits[:, :34]).all()
    gen = Generator.from_bundle(out)
    plain = gen.generate("the cat sat", raw=True, max_new_tokens=20, use_draft=False)
    spec = gen.generate("the cat sat", raw=True, max_new_tokens=20, draft_tokens=3,
                        drafter="model")
    assert spec.token_ids == plain.token_ids
    assert spec.stats["accepted_tokens"] > 0
    # the random target samples its own padding ids (34-39); the draft never proposes them
    assert max(plain.token_ids) >= 34


def test_draft_with_other_special_tokens_is_refused(tiny_checkpoints, tmp_path):
    """The same token -> id map but another end-of-sequence token: refused before any
    weights are loaded, with the token named."""
    draft = save_tiny(tmp_path / "draft", "llama", layers=1)
    tok = char_tokenizer()
    tok.eos_token = "<unk>"
    tok.save_pretrained(draft)
    with pytest.raises(ValueError, match=r"the draft's tokenizer has eos_token_id 0 where the "
                                         r"target's has 2"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft=str(draft))
    assert not (tmp_path / "b").exists()


def test_draft_whose_tokenizer_does_not_fit_its_embedding_is_refused(tiny_checkpoints,
                                                                     tmp_path):
    draft = save_tiny(tmp_path / "draft", "llama", layers=1, vocab_size=20)
    with pytest.raises(ValueError, match=r"the draft's embedding has 20 rows but its "
                                         r"tokenizer uses ids up to 33"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft=str(draft))


# ---- errors that say which step failed ---------------------------------------------------

def _word_level_qwen2(path):
    """A Qwen2.5-style tiny checkpoint: tied embeddings, a word-level tokenizer of a few
    words and the Qwen2 tokenizer class, so that transformers rebuilds it as its byte-level
    BPE and the English verify prompt comes out as no ids at all."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<unk>", "<|endoftext|>", "the", "quick", "brown", "fox", "time", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, eos_token_id=1)
    Qwen2ForCausalLM(config).eval().save_pretrained(path)
    fast.save_pretrained(path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "Qwen2Tokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def test_tied_qwen2_with_a_word_level_tokenizer_verifies(tmp_path):
    """The verify prompt that the tokenizer turns into no ids: --verify runs on test ids
    instead of handing torch an empty (float) tensor."""
    ckpt = _word_level_qwen2(tmp_path / "qwen")
    assert AutoTokenizer.from_pretrained(ckpt)(VERIFY_PROMPT)["input_ids"] == []
    manifest = export_bundle(str(ckpt), tmp_path / "b", draft_layers=1, verify=True)
    assert all(r["ok"] and r["greedy_steps"] == 32 for r in manifest["verify"].values())


def test_verify_failure_is_said_in_words(tiny_checkpoints, tmp_path, monkeypatch):
    """A target graph traced from other weights: the error gives the largest logit difference
    and the first step where greedy tokens part, not the report as JSON."""
    other = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "other", seed=1)).eval()
    real = bundle_writer.export_onnx

    def other_weights(model, path, **kwargs):
        real(other if path.name == "target.onnx" else model, path, **kwargs)

    monkeypatch.setattr(bundle_writer, "export_onnx", other_weights)
    with pytest.raises(bundle_writer.ExportError) as info:
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft_layers=1,
                      verify=True)
    message = str(info.value)
    assert "--verify failed for the target graph: its logits differ from transformers' by " \
           "up to" in message
    assert "(more than the allowed 0.001)" in message
    assert "greedy tokens part from transformers' at step 1 of 32" in message
    assert "draft graph" not in message and "{" not in message
    assert not (tmp_path / "b").exists()


def test_first_greedy_mismatch_is_reported(tiny_checkpoints, tmp_path):
    other = save_tiny(tmp_path / "other", "llama", seed=1)
    export_bundle(str(other), tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    report = verify_graph(model, tmp_path / "b" / "target.onnx", [1, 5, 6, 7])
    assert report["first_greedy_mismatch"] is not None
    assert report["greedy_matches"] <= report["greedy_steps"] - 1
    good = verify_graph(model, tmp_path / "b" / "target.onnx", [1, 5, 6, 7], atol=1e9)
    assert good["first_greedy_mismatch"] == report["first_greedy_mismatch"]


@pytest.mark.parametrize("target, step, advice", [
    ("export_onnx", "export target graph", "try --attention portable"),
    ("quantize_graph", "quantize", "Export with --precision fp32"),
    ("load_model", "load models", "Check that the model (and the draft) is a complete"),
])
def test_a_failed_step_is_named_with_what_to_do(tiny_checkpoints, tmp_path, monkeypatch,
                                                capsys, target, step, advice):
    """A library's error (here ONNX Runtime's wording) never comes alone: the export names
    the step and says what to do, and the command prints it in one line."""
    def fail(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model failed:\n"
                           "indices element out of data bounds")

    monkeypatch.setattr(bundle_writer, target, fail)
    with pytest.raises(bundle_writer.ExportError) as info:
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", precision="int8")
    message = str(info.value)
    assert message.startswith(f"export step '{step}' failed: RuntimeError: [ONNXRuntimeError]")
    assert advice in message and "\n" not in message
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", str(tiny_checkpoints["llama"]), "--out", str(tmp_path / "c"),
              "--precision", "int8"])
    said = capsys.readouterr().err.split("\n")  # the progress bar redraws with \r
    assert said[-2] == f"specedge: error: {message}" and said[-1] == "", said
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_verify_asks_transformers_for_its_cache_by_its_current_name(tiny_checkpoints,
                                                                   tmp_path):
    """--verify reads the model's cache as transformers names it now (`cache`), so the
    export's progress bar carries no deprecation notice. In a process of its own: the notice
    is logged once a process."""
    import subprocess
    import sys

    code = ("from specedge.export.bundle_writer import export_bundle; "
            f"export_bundle({str(tiny_checkpoints['llama'])!r}, {str(tmp_path / 'b')!r}, "
            "draft_layers=1, verify=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deprecated" not in done.stderr, done.stderr[-2000:]
