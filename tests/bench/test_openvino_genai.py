"""OpenVINO GenAI in `specedge bench`: where its exporter is found, the command that makes its
int4 model and the cache that keeps it, the skip lines without the package or an exporter,
its perplexity and its systems' timing on stand-in `openvino` and `openvino_genai` modules,
and its ratios, Pareto line and report line."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from specedge.bench import openvino_genai, report
from specedge.bench.baselines import Generation, pareto_ratios, system_ratios
from specedge.bench.peer_models import BuildError
from specedge.bench.perplexity import perplexity


def test_the_exporter_is_the_named_one_then_the_repositorys_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEDGE_OPTIMUM_CLI", "/opt/ov/bin/optimum-cli")
    assert openvino_genai.exporter() == ["/opt/ov/bin/optimum-cli"]
    monkeypatch.delenv("SPECEDGE_OPTIMUM_CLI")
    monkeypatch.setattr(openvino_genai, "REPO", tmp_path)
    (tmp_path / ".venv-openvino" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-openvino" / "bin" / "optimum-cli").write_text("")
    assert openvino_genai.exporter() == [str(tmp_path / ".venv-openvino/bin/optimum-cli")]
    assert openvino_genai.export_command(["cli"], Path("ck"), Path("out")) == [
        "cli", "export", "openvino", "--model", "ck", "--task", "text-generation-with-past",
        "--weight-format", "int4", "--group-size", "32", "out"]


def test_its_model_is_made_once_into_the_cache(cache, checkpoint, tmp_path, monkeypatch,
                                               capsys):
    made = tmp_path / "made.txt"
    script = tmp_path / "optimum-cli"
    # A stand-in exporter: writes the model file into its last argument, and counts its runs.
    script.write_text(f"#!{sys.executable}\nimport pathlib, sys\n"
                      f"pathlib.Path({str(made)!r}).open('a').write('x')\n"
                      "out = pathlib.Path(sys.argv[-1]); out.mkdir(exist_ok=True)\n"
                      "(out / 'openvino_model.xml').write_text('<net/>')\n")
    script.chmod(0o755)
    monkeypatch.setenv("SPECEDGE_OPTIMUM_CLI", str(script))
    folder = openvino_genai.exported_model(checkpoint, "2026.4.1.0")
    assert folder.parent == cache / "openvino-genai" and folder.name.startswith("ck-int4-g32-")
    assert (folder / "openvino_model.xml").read_text() == "<net/>"
    assert f"building OpenVINO's int4 model (groups of 32) of {checkpoint}" in \
        capsys.readouterr().err
    assert openvino_genai.exported_model(checkpoint, "2026.4.1.0") == folder
    assert made.read_text() == "x"  # not made twice
    assert openvino_genai.model_folder(checkpoint, "2026.5.0.0") != folder


def test_without_the_package_or_an_exporter_both_systems_are_skipped(
        cache, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(openvino_genai, "installed_version", lambda: None)
    systems = openvino_genai.openvino_systems(tmp_path, 8, None, [1, 2, 3])
    assert list(systems) == ["openvino-genai plain", "openvino-genai prompt lookup"]
    assert all(s == {"skipped": "openvino-genai not installed (pip install -e '.[peers]')"}
               for s in systems.values())
    monkeypatch.setattr(openvino_genai, "installed_version", lambda: "2026.4.1.0")
    monkeypatch.setattr(openvino_genai, "bundle_checkpoint", lambda bundle: checkpoint)
    monkeypatch.setattr(openvino_genai, "exporter", lambda: None)
    systems = openvino_genai.openvino_systems(tmp_path, 8, None, [1, 2, 3])
    skipped = systems["openvino-genai plain"]["skipped"]
    assert skipped.startswith("no OpenVINO exporter (optimum-intel) to make its model: bash "
                              "scripts/install_openvino_exporter.sh")
    assert systems["openvino-genai prompt lookup"] == {"skipped": skipped}


class Metric:
    def __init__(self, mean: float):
        self.mean = mean


class StandIns:
    """Stand-in `openvino` and `openvino_genai` modules: a compiled model whose logits are
    `logits`, and pipelines that answer `answer` tokens with the given times (ms)."""

    def __init__(self, logits: np.ndarray, answer: list[int], ttft_ms: float,
                 generate_ms: float):
        self.configs, self.pipelines, self.fed = [], [], {}
        stand_ins = self

        class Request:
            def reset_state(self):
                pass

            def infer(self, feed):
                stand_ins.fed = feed

            def get_tensor(self, name):
                return types.SimpleNamespace(data=logits[None])

        class Core:
            def compile_model(self, path, device, properties):
                stand_ins.compiled = (path, device, properties)
                return types.SimpleNamespace(create_infer_request=Request)

        class Pipeline:
            def __init__(self, folder, device, **properties):
                stand_ins.pipelines.append(properties)

            def generate(self, inputs, config):
                stand_ins.configs.append(config)
                metrics = types.SimpleNamespace(get_ttft=lambda: Metric(ttft_ms),
                                                get_generate_duration=lambda: Metric(generate_ms))
                return types.SimpleNamespace(tokens=[answer], perf_metrics=metrics)

        self.ov = types.ModuleType("openvino")
        self.ov.Core, self.ov.Tensor = Core, lambda array: array
        self.og = types.ModuleType("openvino_genai")
        self.og.LLMPipeline = Pipeline
        self.og.GenerationConfig = types.SimpleNamespace
        self.og.TokenizedInputs = lambda ids, mask: (ids, mask)
        for module in (self.ov, self.og):
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)

    def install(self, monkeypatch) -> None:
        monkeypatch.setitem(sys.modules, "openvino", self.ov)
        monkeypatch.setitem(sys.modules, "openvino_genai", self.og)


def test_its_systems_run_on_its_pipelines_with_its_perplexity(cache, checkpoint, tmp_path,
                                                              monkeypatch):
    rng = np.random.default_rng(0)
    text = [3, 1, 4, 1, 5]
    logits = rng.normal(size=(len(text), 7)).astype(np.float32)
    stand_ins = StandIns(logits, answer=[9, 8, 7, 6], ttft_ms=40.0, generate_ms=100.0)
    stand_ins.install(monkeypatch)
    folder = openvino_genai.model_folder(checkpoint, "2026.4.1.0")
    folder.mkdir(parents=True)
    (folder / "openvino_model.xml").write_text("<net/>")
    monkeypatch.setattr(openvino_genai, "installed_version", lambda: "2026.4.1.0")
    monkeypatch.setattr(openvino_genai, "bundle_checkpoint", lambda bundle: checkpoint)
    systems = openvino_genai.openvino_systems(tmp_path, 4, 2, text)
    plain, lookup = systems["openvino-genai plain"], systems["openvino-genai prompt lookup"]
    assert plain["perplexity"] == lookup["perplexity"] == pytest.approx(perplexity(logits, text))
    assert stand_ins.compiled == (str(folder / "openvino_model.xml"), "CPU",
                                  {"INFERENCE_NUM_THREADS": 2})
    assert stand_ins.fed["input_ids"].tolist() == [text]
    assert stand_ins.fed["position_ids"].tolist() == [list(range(5))]
    assert stand_ins.pipelines == [{"INFERENCE_NUM_THREADS": 2},
                                   {"prompt_lookup": True, "INFERENCE_NUM_THREADS": 2}]
    # Decode time: its generate duration less its time to the first token.
    assert plain["generate"]([5, 6]) == Generation(4, 0.06)
    assert lookup["generate"]([5, 6]) == Generation(4, 0.06)
    first, second = stand_ins.configs
    assert first.max_new_tokens == 4 and not hasattr(first, "num_assistant_tokens")
    assert (second.num_assistant_tokens, second.max_ngram_size) == (4, 3)
    assert lookup["lookup"] == {"num_assistant_tokens": 4, "max_ngram_size": 3}


def test_a_model_keeping_the_last_logits_only_is_named(cache, checkpoint, tmp_path,
                                                       monkeypatch):
    StandIns(np.zeros((1, 7), np.float32), [1], 1.0, 2.0).install(monkeypatch)
    with pytest.raises(BuildError, match="1 rows of logits for a 3-token text"):
        openvino_genai.model_perplexity(tmp_path, [1, 2, 3], None)


def test_it_is_a_peer_of_the_ratios_the_pareto_line_and_the_report():
    def measured(decode, perplexity_):
        return {"rounds": [{"decode_tokens_per_second": d, "tokens_per_second": d}
                           for d in decode], "decode_tokens_per_second": float(np.median(decode)),
                "tokens_per_second": float(np.median(decode)), "perplexity": perplexity_}

    systems = {"specedge plain": measured([10.0, 10.0], 22.0),
               "specedge best": measured([15.0, 12.0], 22.0),
               "openvino-genai plain": {**measured([8.0, 8.0], 27.0), "version": "2026.4.1.0",
                                        "weights": "int4, groups of 32"},
               "openvino-genai prompt lookup": {**measured([10.0, 6.0], 27.0),
                                                "version": "2026.4.1.0",
                                                "weights": "int4, groups of 32",
                                                "lookup": {"num_assistant_tokens": 4}}}
    ratios = {(r["ratio"], r["speed"]): r for r in system_ratios(systems)}
    assert ratios["specedge best / openvino-genai best", "decode"]["denominator"] == \
        "openvino-genai plain"
    assert ratios["specedge plain / openvino-genai plain", "decode"]["rounds"] == [1.25, 1.25]
    line = pareto_ratios(systems)
    assert [(e["denominator"], e["numerator"]) for e in line] == [
        ("openvino-genai plain", "specedge best")] * 2
    text = "\n".join(report._openvino_line(systems))
    assert text == ("\nopenvino-genai 2026.4.1.0: its model from `optimum-cli export openvino` "
                    "(int4, groups of 32); prompt lookup: `num_assistant_tokens=4`.")
