"""scripts/experiments/bench_scaling.py: the speedup it predicts from measured costs, and the
whole script on its tiny shapes (a random-weight model built, exported at int4, measured,
reported)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))

import bench_scaling  # noqa: E402
from bench_scaling import (  # noqa: E402
    ALPHAS,
    MAX_K,
    ONE_LAYER,
    best_k,
    expected_tokens,
    graph_bytes,
    main,
    predicted_speedup,
)

ROW_FIELDS = {"config", "params", "int4_mb", "bundle", "plain_tokens_per_second", "step_ms",
              "r", "draft_step_ms", "c", "predicted", "llama_cpp", "seconds"}
TOP_FIELDS = {"machine", "date", "git_commit", "command", "threads", "runs", "precision",
              "context", "plain_tokens", "max_k", "alphas", "max_context", "shapes"}


def test_predicted_speedup_by_hand():
    # alpha 0.8, K = 3: 1 + 0.8 + 0.64 + 0.512 = 2.952 tokens for 3 * 0.1 + 1.2 steps.
    assert predicted_speedup(0.8, 3, 0.1, 1.2) == pytest.approx(2.952 / 1.5)
    assert expected_tokens(0.8, 3) == pytest.approx(2.952)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert predicted_speedup(1.0, 2, 0.25, 1.5) == pytest.approx(3 / 2.0)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.2, 2)


def test_with_a_flat_verification_cost_it_is_the_design_formula():
    """docs/design.md: ideal(K) = (1 - beta^(K+1)) / ((1 - beta)(1 + c K)), which assumes a
    (K+1)-token call costs one step."""
    for alpha in (0.3, 0.6, 0.9):
        for k in (1, 4, 8):
            for c in (0.0, 0.05, 0.4):
                ideal = (1 - alpha ** (k + 1)) / ((1 - alpha) * (1 + c * k))
                assert predicted_speedup(alpha, k, c, 1.0) == pytest.approx(ideal)


def test_best_k_weighs_the_verification_cost():
    flat = {t: 1.0 for t in range(1, MAX_K + 2)}
    # Free drafts and free verification: the longest K wins.
    assert best_k(0.8, 0.0, flat)[0] == MAX_K
    # Calls past 3 tokens cost double: K = 2 (3 tokens) beats every longer K at alpha 0.6.
    steep = {t: 1.0 if t <= 3 else 2.0 for t in range(1, MAX_K + 2)}
    k, speedup = best_k(0.6, 0.05, steep)
    assert k == 2 and speedup == pytest.approx(predicted_speedup(0.6, 2, 0.05, 1.0))
    assert all(predicted_speedup(0.6, j, 0.05, steep[j + 1]) <= speedup
               for j in range(1, MAX_K + 1))
    # An expensive draft: even the best K loses to plain decoding, and says so.
    assert best_k(0.6, 1.0, flat)[1] < 1
    with pytest.raises(ValueError, match="T = \\[9\\]"):
        best_k(0.7, 0.1, {t: 1.0 for t in range(1, MAX_K + 1)})


def test_graph_size_counts_its_data_file_only(tmp_path):
    """A graph over 2 GB keeps its weights in FILE.onnx.data (the 1B shape's int4 target may);
    the draft's files beside it are not the target's size."""
    for name, size in (("target.onnx", 10), ("target.onnx.data", 1000), ("draft.onnx", 7),
                       ("draft.onnx.data", 300)):
        (tmp_path / name).write_bytes(b"x" * size)
    assert graph_bytes(tmp_path / "target.onnx") == 1010
    assert graph_bytes(tmp_path / "draft.onnx") == 307


def test_unknown_shape_lists_the_published_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--shapes", "GPT-9"])
    err = capsys.readouterr().err
    assert "SmolLM2-135M" in err and "Llama-3.2-1B" in err and "tiny" not in err


def _check_row(row: dict, drafts: set[str]) -> None:
    assert set(row) == ROW_FIELDS
    assert row["int4_mb"] > 0 and row["plain_tokens_per_second"] > 0
    assert set(row["step_ms"]) == set(row["r"]) == {str(t) for t in range(1, MAX_K + 2)}
    assert all(ms > 0 for ms in row["step_ms"].values())
    assert row["r"]["1"] == 1.0 and all(r > 0 for r in row["r"].values())
    for t, r in row["r"].items():
        assert r == pytest.approx(row["step_ms"][t] / row["step_ms"]["1"])
    assert set(row["c"]) == set(row["draft_step_ms"]) == set(row["predicted"]) == drafts
    r = {int(t): v for t, v in row["r"].items()}
    for d, c in row["c"].items():
        assert c > 0 and row["draft_step_ms"][d] > 0
        assert c == pytest.approx(row["draft_step_ms"][d] / row["step_ms"]["1"])
        assert set(row["predicted"][d]) == {str(a) for a in ALPHAS}
        for a in ALPHAS:
            p = row["predicted"][d][str(a)]
            assert 1 <= p["k"] <= MAX_K
            assert p["speedup"] == pytest.approx(predicted_speedup(a, p["k"], c, r[p["k"] + 1]))
            assert p["speedup"] == pytest.approx(best_k(a, c, r)[1])
    assert row["seconds"]["measure"] > 0
    llama = row["llama_cpp"]
    assert llama.get("tokens_per_second", 0) > 0 or llama["skipped"]


def test_script_on_the_tiny_shape(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    main(["--shapes", "tiny", "--runs", "3", "--threads", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    printed = capsys.readouterr().out

    assert set(results) == TOP_FIELDS
    m = results["machine"]
    assert m["cpu"] and m["cores"] >= 1 and all(f.startswith(("avx", "amx")) for f in m["flags"])
    assert datetime.datetime.fromisoformat(results["date"]).tzinfo is not None
    assert len(results["git_commit"]) >= 40
    assert "--shapes tiny" in results["command"]
    assert (results["threads"], results["runs"], results["precision"]) == (1, 3, "int4")
    assert list(results["shapes"]) == ["tiny"]
    row = results["shapes"]["tiny"]
    _check_row(row, {ONE_LAYER, "tiny-draft"})
    # The config was built as written: 4 layers of width 64 (4 heads of 16, 2 KV heads), MLP
    # 128, 1024 tokens, tied embeddings counted once.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert row["params"] == 1024 * 64 + 4 * per_layer + 64

    assert "| shape | params | int4 MB | plain tok/s | r(5) |" in printed
    readme_row = f"| tiny | 214K | {row['int4_mb']:.0f} | {row['plain_tokens_per_second']:.1f} |"
    assert readme_row in printed
    if "skipped" in row["llama_cpp"]:
        assert f"llama.cpp column skipped: {row['llama_cpp']['skipped']}" in printed
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama-cpp-python not installed" in row["llama_cpp"]["skipped"]
    elif importlib.util.find_spec("gguf_writer") is not None:
        # llama.cpp ran on the same random weights, written as Q4_1
        assert row["llama_cpp"]["tokens_per_second"] > 0 and row["llama_cpp"]["quant"] == "q4_1"
        assert f"| {row['llama_cpp']['tokens_per_second']:.1f} |" in printed

    # A second run reuses the checkpoints and bundles; a shape that is its own small draft
    # reports only the one-layer draft.
    cache = tmp_path / "scaling"
    kept = {p: p.stat().st_mtime_ns for p in (cache / "models" / "tiny-draft" / "config.json",
                                               cache / "bundles" / "tiny-draft" / "manifest.json")}
    main(["--shapes", "tiny-draft", "--runs", "1", "--threads", "1", "--out", str(out)])
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    row = json.loads(out.read_text())["shapes"]["tiny-draft"]
    _check_row(row, {ONE_LAYER})
    assert "| tiny-draft | 140K |" in capsys.readouterr().out


def test_a_shape_that_fails_to_export_is_reported_and_the_next_one_still_tried(
        tmp_path, monkeypatch, capsys):
    """The four shapes take an hour: one export failing (the 1B shape needs ONNX external
    data) must not lose the others' figures."""
    from specedge.export.bundle_writer import ExportError

    def export(name, checkpoint, cache):
        raise ExportError(f"export step 'export target graph' failed for {name}")

    monkeypatch.setattr(bench_scaling, "build_checkpoint", lambda name, cache: cache / name)
    monkeypatch.setattr(bench_scaling, "export", export)
    out = tmp_path / "scaling.json"
    main(["--shapes", "tiny-draft", "tiny", "--runs", "1", "--out", str(out)])
    why = "export step 'export target graph' failed for {}"
    assert json.loads(out.read_text())["shapes"] == {
        "tiny-draft": {"failed": why.format("tiny-draft")}, "tiny": {"failed": why.format("tiny")}}
    printed = capsys.readouterr().out
    for name in ("tiny-draft", "tiny"):
        assert f"{name}: not measured: {why.format(name)}" in printed


class _StandInLlama:
    """llama_cpp.Llama as the script drives it: eval() appends after n_tokens (which the
    script sets back to the prompt), the logits of the last call peak at the token that
    follows the last one fed."""

    def __init__(self, model_path, n_ctx, n_threads, n_batch, verbose):
        assert Path(model_path).stat().st_size > 0 and n_threads == 1
        self.ctx, self.n_tokens, self.fed = object(), 0, []

    def eval(self, tokens):
        self.fed = self.fed[:self.n_tokens] + list(tokens)
        self.n_tokens = len(self.fed)


def test_llama_cpp_column_with_a_stand_in(tmp_path, monkeypatch):
    """The llama.cpp block writes the Q4_1 GGUF, evaluates the prompt once, and each timed run
    goes back to the prompt and feeds PLAIN_TOKENS tokens, each the argmax of the last
    call's logits (real llama-cpp-python: scripts/install_llama_cpp.sh)."""
    import ctypes
    import importlib.machinery
    import types

    import gguf

    import specedge.bench.baselines as baselines

    vocab = bench_scaling.SHAPES["tiny"]["config"]["vocab_size"]
    llms = []

    def logits(ctx):
        row = (ctypes.c_float * vocab)()
        row[(llms[-1].fed[-1] + 1) % vocab] = 1.0
        return row

    def llama(**kwargs):
        llms.append(_StandInLlama(**kwargs))
        return llms[-1]

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama, fake.llama_get_logits = llama, logits
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(baselines, "_llama_cpp_batch", lambda path, threads: 512)

    checkpoint = bench_scaling.build_checkpoint("tiny", tmp_path)
    run, info = bench_scaling.llama_cpp_block("tiny", checkpoint, tmp_path, 1, vocab)
    assert info["quant"] == "q4_1" and info["n_batch"] == 512
    types_ = {t.tensor_type.name for t in gguf.GGUFReader(info["gguf"]).tensors}
    assert "Q4_1" in types_
    prompt = bench_scaling.prompt_ids(vocab)
    for _ in range(2):
        assert run() > 0
        llm = llms[-1]
        assert llm.fed[:bench_scaling.CONTEXT] == prompt
        decoded = llm.fed[bench_scaling.CONTEXT:]
        # the prompt's argmax first, then each step's
        assert decoded == [(prompt[-1] + i) % vocab
                           for i in range(1, bench_scaling.PLAIN_TOKENS + 1)]
    assert len(llms) == 1


def test_llama_cpp_column_is_skipped_with_its_reason(tmp_path, monkeypatch):
    import importlib.machinery
    import types

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "gguf_writer", None)  # not importable
    run, info = bench_scaling.llama_cpp_block("tiny", tmp_path, tmp_path, 1, 1024)
    assert run is None and info["skipped"].startswith("no GGUF writer")
