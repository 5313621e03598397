"""onnxruntime-genai in `specedge bench`: its model builder's command lines, the cache of the
models it builds, the skip line without the package, its systems' timing on a stand-in
module, its ratios and report lines; and, with the package installed, its models built on a
tiny model, its systems timed beside ours, and the report."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from specedge.bench import ort_genai, ort_genai_models, report
from specedge.bench.baselines import Generation, system_ratios
from specedge.bench.ort_genai_models import (
    DEFAULT,
    K_QUANT,
    BuildError,
    builder_command,
    built_model,
    model_folder,
)
from specedge.cli import main

NOT_INSTALLED = "onnxruntime-genai not installed (pip install -e '.[peers]')"


def test_builder_command_builds_int4_for_the_cpu_from_the_checkpoint(tmp_path):
    common = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
              str(tmp_path / "ck"), "-o", str(tmp_path / "out"), "-p", "int4", "-e", "cpu",
              "-c", str(tmp_path / "hf")]
    assert builder_command(tmp_path / "ck", tmp_path / "out", DEFAULT, tmp_path / "hf") == common
    assert builder_command(tmp_path / "ck", tmp_path / "out", K_QUANT, tmp_path / "hf") == [
        *common, "--extra_options", "algo_config=k_quant_last"]


def test_models_are_cached_by_checkpoint_options_and_version(cache, checkpoint):
    default = model_folder(checkpoint, DEFAULT, "0.18.0")
    assert default.parent == cache / "onnxruntime-genai"
    assert default.name.startswith("ck-default-")
    assert model_folder(checkpoint, DEFAULT, "0.18.0") == default  # stable
    assert model_folder(checkpoint, K_QUANT, "0.18.0").name.startswith("ck-k-quant-")
    assert model_folder(checkpoint, DEFAULT, "0.18.1") != default
    (checkpoint / "model.safetensors").write_bytes(b"\1" * 65)  # the checkpoint rewritten
    assert model_folder(checkpoint, DEFAULT, "0.18.0") != default


def fake_builder(monkeypatch, script: str) -> None:
    """The model builder replaced by `script` (run with the output folder as argv[1]), and
    torch reported installed, so that building runs without either."""
    monkeypatch.setattr(ort_genai_models, "builder_command",
                        lambda ck, out, variant, hf: [sys.executable, "-c", script, str(out)])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        importlib.machinery.ModuleSpec("torch", None) if name == "torch" else real(name, *a)))


def test_a_model_is_built_once_then_read_from_the_cache(cache, checkpoint, monkeypatch,
                                                        capsys):
    fake_builder(monkeypatch, "import pathlib, sys; "
                              "(pathlib.Path(sys.argv[1]) / 'genai_config.json').write_text('{}')")
    folder = built_model(checkpoint, K_QUANT, "0.18.0")
    assert folder == model_folder(checkpoint, K_QUANT, "0.18.0")
    assert (folder / "genai_config.json").read_text() == "{}"
    err = capsys.readouterr().err
    assert f"building onnxruntime-genai's int4 k-quant model of {checkpoint} into {folder}" in err
    assert f"built {folder.name} in " in err
    fake_builder(monkeypatch, "raise SystemExit('built again')")
    assert built_model(checkpoint, K_QUANT, "0.18.0") == folder
    assert capsys.readouterr().err == ""


def test_a_failed_build_names_the_builders_last_line_and_its_log(cache, checkpoint,
                                                                monkeypatch):
    fake_builder(monkeypatch, "print('quantizing'); print('ValueError: cannot reshape'); "
                              "raise SystemExit(1)")
    folder = model_folder(checkpoint, DEFAULT, "0.18.0")
    with pytest.raises(BuildError) as failed:
        built_model(checkpoint, DEFAULT, "0.18.0")
    log = folder.with_name(folder.name + ".build.log")
    assert str(failed.value) == (f"onnxruntime-genai's model builder failed on {checkpoint} "
                                 f"(exit status 1): ValueError: cannot reshape; its output is "
                                 f"in {log}")
    assert "quantizing" in log.read_text()
    assert not folder.exists() and [p.name for p in folder.parent.iterdir()] == [log.name]


def test_building_without_torch_says_what_to_install(cache, checkpoint, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(BuildError, match=r"needs torch and transformers \(pip install -e "
                                         r"'\.\[export\]'\)"):
        built_model(checkpoint, DEFAULT, "0.18.0")


def test_without_the_package_every_system_is_skipped_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(ort_genai, "installed_version", lambda: None)
    systems = ort_genai.ort_genai_systems(tmp_path, 8, None, [1, 2, 3])
    assert list(systems) == ["onnxruntime-genai plain", "onnxruntime-genai n-gram",
                             "onnxruntime-genai k-quant plain",
                             "onnxruntime-genai k-quant n-gram"] == list(ort_genai.NAMES)
    assert all(row == {"skipped": NOT_INSTALLED} for row in systems.values())
    text = "\n".join(report._systems_markdown(
        {**SAMPLE, "systems": {**OURS, **systems}, "system_ratios": []}))
    assert f"| onnxruntime-genai plain | skipped: {NOT_INSTALLED} | | | |" in text
    assert (f"No ratio to onnxruntime-genai: onnxruntime-genai plain: {NOT_INSTALLED}; "
            in text)


class FakeClock:
    """Stands in for the `time` module of ort_genai.py."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def stand_in_og(monkeypatch, clock: FakeClock, prompt_s: float, step_s: float,
                eos_after: int, buffered: int, vocab: int = 5) -> list:
    """onnxruntime_genai as ort_genai.py drives it: `append_tokens` spends prompt_s on the
    prompt, the first `generate_next_token` picks from its logits, each later one spends
    step_s; the sequence ends after eos_after tokens; after the first token, `buffered`
    tokens wait in its speculative buffer. Returns what was made, to inspect."""
    made = []

    class Config:
        def __init__(self, folder):
            self.folder, self.overlays = folder, []
            made.append(self)

        def overlay(self, text):
            self.overlays.append(json.loads(text))

    class Model:
        def __init__(self, config):
            self.config = config

    class GeneratorParams:
        def __init__(self, model):
            self.search, self.speculative = {}, None
            made.append(self)

        def set_search_options(self, **options):
            self.search = options

        def set_speculative_options(self, **options):
            self.speculative = options

    class Generator:
        def __init__(self, model, params):
            self.params, self.tokens, self.prompt = params, 0, None

        def append_tokens(self, ids):
            assert ids.dtype == np.int32 and ids.shape[0] == 1
            self.prompt = ids[0].tolist()
            clock.now += prompt_s

        def get_output(self, name):
            assert name == "logits"
            return np.zeros((1, len(self.prompt), vocab), dtype=np.float32)

        def generate_next_token(self):
            if self.tokens:
                clock.now += step_s
            self.tokens += 1

        def is_done(self):
            return self.tokens >= eos_after

        def get_speculative_stats(self):
            return {"tokens_buffered": buffered}

    fake = types.ModuleType("onnxruntime_genai")
    fake.__spec__ = importlib.machinery.ModuleSpec("onnxruntime_genai", None)
    fake.Config, fake.Model = Config, Model
    fake.GeneratorParams, fake.Generator = GeneratorParams, Generator
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", fake)
    monkeypatch.setattr(ort_genai, "time", clock)
    return made


def test_decode_time_starts_at_the_first_token_and_counts_what_came_with_it(monkeypatch):
    clock = FakeClock()
    made = stand_in_og(monkeypatch, clock, prompt_s=2.0, step_s=0.25, eos_after=100,
                       buffered=2)
    model = types.SimpleNamespace()
    plain = ort_genai.generate_with(model, 9, None)
    assert plain([5, 6, 7]) == Generation(9, 8 * 0.25, 1)
    assert clock.now == 2.0 + 8 * 0.25
    assert made[-1].search == {"max_length": 3 + 9, "do_sample": False}
    assert made[-1].speculative is None
    # n-gram: the two tokens its first verification left in the buffer came with the first
    ngram = ort_genai.generate_with(model, 9, ort_genai.NGRAM)
    assert ngram([5, 6, 7]) == Generation(9, 8 * 0.25, 3)
    assert made[-1].speculative == ort_genai.NGRAM


def test_generation_stops_at_its_end_of_sequence(monkeypatch):
    clock = FakeClock()
    stand_in_og(monkeypatch, clock, prompt_s=1.0, step_s=0.5, eos_after=4, buffered=9)
    assert ort_genai.generate_with(None, 9, None)([1]) == Generation(4, 1.5, 1)
    # never more first tokens than tokens
    assert ort_genai.generate_with(None, 9, ort_genai.NGRAM)([1]) == Generation(4, 1.5, 4)


def test_systems_share_each_variants_model_and_perplexity(monkeypatch, tmp_path):
    """Both variants are built, opened on --threads and scored on the text; a variant the
    builder cannot build is skipped with its reason while the other runs."""
    clock = FakeClock()
    made = stand_in_og(monkeypatch, clock, prompt_s=1.0, step_s=0.5, eos_after=100,
                       buffered=0)
    monkeypatch.setattr(ort_genai, "installed_version", lambda: "0.18.0")
    monkeypatch.setattr(ort_genai, "bundle_checkpoint", lambda bundle: tmp_path / "ck")

    def build(checkpoint, variant, version):
        if variant == K_QUANT:
            raise BuildError("the builder failed: no k-quant here")
        return tmp_path / variant.slug

    monkeypatch.setattr(ort_genai, "built_model", build)
    systems = ort_genai.ort_genai_systems(tmp_path / "bundle", 6, 3, [1, 2, 3, 4])
    assert list(systems) == list(ort_genai.NAMES)
    plain, ngram = systems["onnxruntime-genai plain"], systems["onnxruntime-genai n-gram"]
    for row in (plain, ngram):
        assert row["perplexity"] == pytest.approx(5.0)  # uniform logits over 5 tokens
        assert row["model"] == str(tmp_path / "default") and row["version"] == "0.18.0"
        assert row["variant"] == "default" and row["builder_options"] == []
        assert row["generate"]([1, 2]) == Generation(6, 2.5, 1)
    assert ngram["speculative"] == ort_genai.NGRAM and "speculative" not in plain
    configs = [m for m in made if hasattr(m, "overlays")]
    assert [c.overlays for c in configs] == [
        [{"model": {"decoder": {"session_options": {"intra_op_num_threads": 3}}}}]]
    for name in ("onnxruntime-genai k-quant plain", "onnxruntime-genai k-quant n-gram"):
        assert systems[name] == {"skipped": "the builder failed: no k-quant here"}


def test_a_model_it_cannot_run_is_skipped_with_its_error(monkeypatch, tmp_path):
    clock = FakeClock()
    stand_in_og(monkeypatch, clock, prompt_s=0.0, step_s=0.0, eos_after=1, buffered=0)

    def cannot_run(config):
        raise RuntimeError("head_size shall be a multiple of 16")

    monkeypatch.setattr(sys.modules["onnxruntime_genai"], "Model", cannot_run)
    monkeypatch.setattr(ort_genai, "installed_version", lambda: "0.18.0")
    monkeypatch.setattr(ort_genai, "bundle_checkpoint", lambda bundle: tmp_path / "ck")
    monkeypatch.setattr(ort_genai, "built_model", lambda ck, variant, v: tmp_path / variant.slug)
    systems = ort_genai.ort_genai_systems(tmp_path / "bundle", 6, None, [1, 2, 3])
    assert systems["onnxruntime-genai n-gram"] == {
        "skipped": f"its model in {tmp_path / 'default'} does not run here: head_size shall "
                   "be a multiple of 16"}
    assert systems["onnxruntime-genai k-quant plain"]["skipped"].startswith(
        f"its model in {tmp_path / 'k-quant'} does not run here")


def test_a_model_with_a_pruned_head_is_refused(monkeypatch):
    clock = FakeClock()
    stand_in_og(monkeypatch, clock, prompt_s=0.0, step_s=0.0, eos_after=1, buffered=0)
    sys.modules["onnxruntime_genai"].Generator.get_output = (
        lambda self, name: np.zeros((1, 1, 5), dtype=np.float32))
    with pytest.raises(BuildError, match="1 rows of logits for a 4-token text"):
        ort_genai.model_perplexity(None, [1, 2, 3, 4])


def measured(decode: list[float], end_to_end: list[float]) -> dict:
    """A timed system's result as `time_systems` gives it, from its speeds per round."""
    return {"rounds": [{"decode_tokens_per_second": d, "tokens_per_second": e}
                       for d, e in zip(decode, end_to_end, strict=True)],
            "decode_tokens_per_second": float(np.median(decode)),
            "tokens_per_second": float(np.median(end_to_end))}


def test_ratios_to_onnxruntime_genai_follow_llama_cpps():
    systems = {
        "specedge best": measured([12.0, 12.0], [10.0, 10.0]),
        "specedge plain": measured([6.0, 6.0], [5.0, 5.0]),
        "llama.cpp plain": measured([4.0, 4.0], [4.0, 4.0]),
        "onnxruntime-genai plain": measured([3.0, 3.0], [2.0, 2.0]),
        "onnxruntime-genai n-gram": measured([4.0, 4.0], [2.5, 2.5]),
        "onnxruntime-genai k-quant plain": measured([2.0, 2.0], [5.0, 5.0]),
        "onnxruntime-genai k-quant n-gram": {"skipped": "not built"},
    }
    quoted = [(r["ratio"], r["speed"], r["denominator"], r["rounds"])
              for r in system_ratios(systems)]
    assert quoted == [
        ("specedge best / llama.cpp best", "decode", "llama.cpp plain", [3.0, 3.0]),
        ("specedge best / llama.cpp best", "end to end", "llama.cpp plain", [2.5, 2.5]),
        ("specedge plain / llama.cpp plain", "decode", "llama.cpp plain", [1.5, 1.5]),
        ("specedge plain / llama.cpp plain", "end to end", "llama.cpp plain", [1.25, 1.25]),
        ("specedge best / onnxruntime-genai best", "decode", "onnxruntime-genai n-gram",
         [3.0, 3.0]),
        ("specedge best / onnxruntime-genai best", "end to end",
         "onnxruntime-genai k-quant plain", [2.0, 2.0]),
        ("specedge plain / onnxruntime-genai plain", "decode", "onnxruntime-genai plain",
         [2.0, 2.0]),
        ("specedge plain / onnxruntime-genai plain", "end to end", "onnxruntime-genai plain",
         [2.5, 2.5])]


SAMPLE = {"bundle": "b", "prompts": 2, "prompt_file": None, "max_new_tokens": 9,
          "precision": "int4", "quick": False, "categories": {},
          "configurations": {}, "systems_prompts": 2, "systems_rounds": 2,
          "quality_tokens": 512}
OURS = {"specedge plain": {**measured([6.0, 6.0], [5.0, 5.0]), "perplexity": 9.0},
        "specedge best": {**measured([12.0, 12.0], [10.0, 10.0]), "perplexity": 9.0,
                          "configuration": "greedy/draft K=2"}}


def test_report_of_a_run_against_onnxruntime_genai():
    def ran(variant: str, options: list[str], **extra) -> dict:
        return {**measured([3.0, 4.0], [2.0, 2.0]), "perplexity": 9.5, "model": "m",
                "version": "0.18.0", "variant": variant, "builder_options": options, **extra}

    systems = {**OURS,
               "onnxruntime-genai plain": ran("default", []),
               "onnxruntime-genai n-gram": ran("default", [], speculative=ort_genai.NGRAM),
               "onnxruntime-genai k-quant plain": ran("k-quant", ["algo_config=k_quant_last"]),
               "llama.cpp plain": {"skipped": "llama-cpp-python not installed"}}
    run = {**SAMPLE, "systems": systems, "system_ratios": system_ratios(systems)}
    json.dumps(run)
    text = "\n".join(report._systems_markdown(run))
    assert "| onnxruntime-genai k-quant plain | 2.0 | 3.5 | 9.50 | 2.0 2.0 |" in text
    assert "Ratios to onnxruntime-genai: per round" in text
    assert ("| specedge best / onnxruntime-genai best (onnxruntime-genai plain) | decode | "
            "3.50x |") in text
    assert "| specedge plain / onnxruntime-genai plain | end to end | 2.50x |" in text
    assert "No ratio to llama.cpp: llama.cpp plain: llama-cpp-python not installed." in text
    assert text.rstrip().endswith(
        "onnxruntime-genai 0.18.0: int4 CPU models from its model builder (`-p int4 -e "
        "cpu`), default: its defaults, k-quant: `--extra_options algo_config=k_quant_last`; "
        "n-gram: `ngram_size=3` `max_draft_tokens=4`.")


def test_bench_compares_with_onnxruntime_genai_when_chosen(own_tiny_bundle, tmp_path,
                                                          monkeypatch):
    """`--baselines onnxruntime-genai` runs its systems (a stand-in here) and nothing else."""
    import time

    from specedge.bench import baselines

    def not_chosen(*args):
        raise AssertionError("a baseline ran though --baselines left it out")

    def stand_in(bundle, max_new_tokens, threads, text_ids):
        assert Path(bundle) == own_tiny_bundle and threads is None and len(text_ids) > 100

        def generate(ids):
            time.sleep(0.002)
            return Generation(max_new_tokens, 0.001)
        return {name: {"generate": generate, "perplexity": 4.0} for name in ort_genai.NAMES}

    monkeypatch.setattr(baselines, "transformers_systems", not_chosen)
    monkeypatch.setattr(baselines, "llama_cpp_systems", not_chosen)
    monkeypatch.setattr(ort_genai, "ort_genai_systems", stand_in)
    out = tmp_path / "bench"
    main(["bench", "--bundle", str(own_tiny_bundle), "--limit", "2", "--max-new-tokens", "6",
          "--ks", "2", "--baselines", "onnxruntime-genai", "--rounds", "2", "--out", str(out)])
    results = json.loads((out / "bench.json").read_text())
    assert list(results["systems"]) == ["specedge plain", "specedge best", *ort_genai.NAMES]
    assert {(r["ratio"], r["speed"]) for r in results["system_ratios"]} == {
        (f"specedge {ours} / onnxruntime-genai {theirs}", speed)
        for ours, theirs in (("best", "best"), ("plain", "plain"))
        for speed in ("decode", "end to end")}


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                    reason="onnxruntime-genai not installed (pip install -e '.[peers]'): its "
                           "model builder and generator cannot run")
def test_onnxruntime_genai_builds_runs_and_is_reported(tiny_fused_bundle, cache, capsys):
    """The real package on a tiny model (head size 16, as its attention needs; hidden size
    64, as its k-quant needs): both models built into the cache once, every system generates
    and is timed beside ours, its perplexity is that of the same untrained weights, and the
    report quotes the ratios to it."""
    from specedge.bench.baselines import quality_text_ids, time_systems
    from specedge.bench.perplexity import model_perplexity
    from specedge.bench.run import _ours
    from specedge.prompts import load_prompts, prompt_input
    from specedge.runtime import Generator
    from specedge.runtime.backends.ort_cpu import OrtCpuBackend

    gen = Generator.from_bundle(tiny_fused_bundle)
    prompts = load_prompts()
    text_ids = quality_text_ids(gen.codec, prompts)[:gen.bundle.target.max_context]
    ours = model_perplexity(OrtCpuBackend(gen.bundle.target, 1), text_ids)
    systems = ort_genai.ort_genai_systems(tiny_fused_bundle, 8, 1, text_ids)
    assert capsys.readouterr().err.count("building onnxruntime-genai's int4") == 2
    assert list(systems) == list(ort_genai.NAMES)
    for row in systems.values():
        assert Path(row["model"]).parent == cache / "onnxruntime-genai", row.get("skipped")
        assert row["version"] == importlib.metadata.version("onnxruntime-genai")
        # int4 of the same random weights: near ours, far from the vocabulary's worth
        assert 10 < row["perplexity"] < 1e4 and abs(np.log(row["perplexity"] / ours)) < 0.5
    assert systems["onnxruntime-genai k-quant n-gram"]["speculative"] == ort_genai.NGRAM
    plain = {"use_draft": False}
    timed = time_systems({"specedge plain": _ours(gen, plain, 8, ours),
                          "specedge best": {**_ours(gen, plain, 8, ours),
                                            "configuration": "greedy/plain"}, **systems},
                         [gen.encode_prompt(**prompt_input(p)) for p in prompts[:2]], rounds=2)
    for name in ort_genai.NAMES:
        for r in timed[name]["rounds"]:
            assert r["tokens"] > 0 and r["seconds"] > r["decode_seconds"] > 0
    ratios = system_ratios(timed)
    assert [(r["ratio"], r["speed"]) for r in ratios] == [
        (f"specedge {which} / onnxruntime-genai {which}", speed)
        for which in ("best", "plain") for speed in ("decode", "end to end")]
    text = report.markdown({**SAMPLE, "systems": timed, "system_ratios": ratios})
    assert "| specedge plain / onnxruntime-genai plain | decode |" in text
    assert ("int4 CPU models from its model builder (`-p int4 -e cpu`), default: its defaults, "
            "k-quant: `--extra_options algo_config=k_quant_last`") in text
    # the next run reads both models from the cache
    again = ort_genai.ort_genai_systems(tiny_fused_bundle, 4, 1, text_ids)
    assert capsys.readouterr().err == ""
    assert [row["model"] for row in again.values()] == [row["model"] for row in systems.values()]
