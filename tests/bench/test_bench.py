"""`specedge bench` on a tiny bundle: every configuration runs and every output is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specedge.bench.configs import aggregate, configurations
from specedge.cli import main
from specedge.prompts import load_prompts


def test_prompt_set_covers_the_three_tasks():
    prompts = load_prompts()
    cats = {p["category"] for p in prompts}
    assert len(prompts) >= 30 and cats == {"chat", "summarize", "code"}
    assert all(p["prompt"].strip() for p in prompts)


def test_every_configuration_names_its_drafter():
    """The generator's default drafter is lookup+model: the draft model's rows must ask for
    it by name, or they would measure the default."""
    for name, kwargs in configurations([1, 2], has_draft=True):
        if kwargs.get("use_draft", True):
            drafter = name.split("/")[1].rsplit(" ", 1)[0]
            assert kwargs["drafter"] == {"draft": "model"}.get(drafter, drafter), name


def test_bench_writes_json_markdown_and_plots(own_tiny_bundle, tiny_batched_bundle, tmp_path,
                                              capsys, monkeypatch):
    """The whole bench on the tiny bundle, with `--baselines llama.cpp` answered by stand-in
    llama.cpp systems (transformers must not load), another export of the model timed
    beside them (`--also`) and two rounds of the systems."""
    import time

    from specedge.bench import baselines

    def not_chosen(*args):
        raise AssertionError("transformers ran though --baselines left it out")

    def llama_cpp(gguf, max_new_tokens, threads, text_ids):
        def generate(ids):
            time.sleep(0.003)
            return baselines.Generation(max_new_tokens, 0.002)
        row = {"generate": generate, "perplexity": 3.0, "n_batch": 512, "flash_attn": True,
               "build": "STAND-IN BUILD"}
        return {"llama.cpp plain": row, "llama.cpp prompt lookup": {
            "skipped": "llama-cpp-python not installed (bash scripts/install_llama_cpp.sh)"}}

    monkeypatch.setattr(baselines, "transformers_systems", not_chosen)
    monkeypatch.setattr(baselines, "llama_cpp_systems", llama_cpp)
    out = tmp_path / "bench"
    main(["bench", "--bundle", str(own_tiny_bundle), "--limit", "3", "--max-new-tokens", "12",
          "--ks", "2", "3", "--baselines", "llama.cpp", "--rounds", "2", "--out", str(out),
          "--store-auto-k", "--also", str(tiny_batched_bundle)])
    results = json.loads((out / "bench.json").read_text())
    configs = results["configurations"]
    assert set(configs) == {"greedy/plain", "greedy/draft K=2", "greedy/draft K=3",
                            "greedy/draft auto", "greedy/prompt-lookup K=4",
                            "greedy/prompt-lookup auto", "greedy/lookup+model K=2",
                            "greedy/lookup+model auto", "sampled/plain",
                            "sampled/draft K=2", "sampled/draft auto",
                            "sampled/prompt-lookup auto", "sampled/lookup+model K=2",
                            "sampled/lookup+model auto"}
    assert configs["greedy/plain"]["speedup"] == 1.0
    for row in configs.values():
        assert row["tokens_per_second"] > 0 and 0 <= row["outside_model_share"] < 1
        assert row["measured_over_ideal"] > 0
    assert len(configs["greedy/draft K=3"]["acceptance_per_position"]) == 3
    # --store-auto-k: what auto K measured over the runs is stored in the bundle for the
    # next Generator.
    stored = json.loads(Path(results["auto_k"]).read_text())
    assert Path(results["auto_k"]) == own_tiny_bundle / "auto_k.json"
    assert {(e["source"], e["greedy"]) for e in stored["acceptance"]} >= {("model", True),
                                                                            ("model", False)}
    assert stored["machines"][0]["written_by"] == "specedge bench"
    systems = results["systems"]
    other = f"specedge {tiny_batched_bundle.name}"
    assert list(systems) == ["specedge plain", "specedge best", f"{other} plain",
                             f"{other} default", "llama.cpp plain", "llama.cpp prompt lookup"]
    best = systems["specedge best"]["configuration"]
    assert best.startswith("greedy/") and best in configs
    assert results["systems_rounds"] == 2 and results["systems_prompts"] == 3
    for name in ("specedge plain", "specedge best", f"{other} default",
                 "llama.cpp plain"):  # taking turns
        system = systems[name]
        assert len(system["rounds"]) == 2
        for r in system["rounds"]:
            assert r["tokens"] > 0 and r["tokens_per_second"] == r["tokens"] / r["seconds"]
            assert r["decode_tokens"] == r["tokens"] - 3  # the first token of 3 prompts
            assert r["decode_tokens_per_second"] == r["decode_tokens"] / r["decode_seconds"]
            assert r["seconds"] > r["decode_seconds"] > 0
        assert system["tokens_per_second"] == pytest.approx(
            (system["rounds"][0]["tokens_per_second"]
             + system["rounds"][1]["tokens_per_second"]) / 2)  # the median of two
    # The tiny model is untrained: its perplexity is near its vocabulary size, not 1.
    ppl = systems["specedge plain"]["perplexity"]
    assert 10 < ppl < 1e4 and systems["specedge best"]["perplexity"] == ppl
    assert results["quality_tokens"] > 100
    # The other export's perplexity is its own graph's: the same tiny weights, another layout.
    assert systems[f"{other} plain"]["perplexity"] == pytest.approx(ppl, rel=1e-3)
    assert systems[f"{other} default"]["perplexity"] == systems[f"{other} plain"]["perplexity"]
    # The stand-in llama.cpp's perplexity (3.0) is below all of ours: the Pareto line has no
    # ratio for it and names our lowest.
    pareto = results["pareto"]
    assert [(e["denominator"], e["speed"], e["numerator"]) for e in pareto] == [
        ("llama.cpp plain", "decode", None), ("llama.cpp plain", "end to end", None)]
    assert pareto[0]["lowest_perplexity"] == min(
        s["perplexity"] for name, s in systems.items() if name.startswith("specedge "))
    # Against the stand-in llama.cpp: its prompt lookup skipped, its plain system is best.
    ratios = results["system_ratios"]
    assert [(r["ratio"], r["speed"], r["denominator"]) for r in ratios] == [
        ("specedge best / llama.cpp best", "decode", "llama.cpp plain"),
        ("specedge best / llama.cpp best", "end to end", "llama.cpp plain"),
        ("specedge plain / llama.cpp plain", "decode", "llama.cpp plain"),
        ("specedge plain / llama.cpp plain", "end to end", "llama.cpp plain")]
    for r in ratios:
        assert len(r["rounds"]) == 2 and r["ci95"][0] <= r["median"] <= r["ci95"][1]
    for name in ("bench.md", "speedup_vs_k.png", "acceptance_per_position.png",
                 "systems.png"):
        assert (out / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| greedy/draft K=2 |" in printed
    assert "| configuration | chat |" in printed and "| greedy/plain | 1.00x |" in printed
    plain = systems["specedge plain"]
    assert (f"| specedge plain | {plain['tokens_per_second']:.1f} | "
            f"{plain['decode_tokens_per_second']:.1f} | {ppl:.2f} |") in printed
    assert (f"| specedge plain / llama.cpp plain | decode | {ratios[2]['median']:.2f}x | "
            f"{ratios[2]['ci95'][0]:.2f}–{ratios[2]['ci95'][1]:.2f}x |") in printed
    assert printed.count("STAND-IN BUILD") == 1
    assert "| llama.cpp plain (3.00) | decode | none: our lowest is specedge" in printed


def test_systems_take_turns_prompt_by_prompt():
    """Every system generates once to warm up, then once per prompt, the first of them
    changing each prompt; a skipped system is reported, not run."""
    from specedge.bench.baselines import Generation, time_systems

    calls = []

    def system(name, tokens):
        def generate(ids):
            calls.append((name, ids[0]))
            return Generation(tokens, 0.001)
        return {"generate": generate, "perplexity": 1.5}

    systems = {"a": system("a", 3), "b": system("b", 5), "c": {"skipped": "not installed"}}
    results = time_systems(systems, [[0], [1], [2]])
    assert calls == [("a", 0), ("b", 0),                          # warm-up
                     ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    (a,), (b,) = results["a"]["rounds"], results["b"]["rounds"]
    assert a["tokens"] == 9 and b["tokens"] == 15
    assert results["a"]["tokens_per_second"] == 9 / a["seconds"]
    assert results["a"]["decode_tokens_per_second"] == pytest.approx(6 / 0.003)
    assert results["a"]["perplexity"] == 1.5 and "generate" not in results["a"]
    assert results["c"] == {"skipped": "not installed"}


def test_perplexity_of_known_distributions():
    from specedge.bench.perplexity import perplexity

    ids = [0, 1, 2, 3]
    assert perplexity(np.zeros((4, 7)), ids) == pytest.approx(7.0)  # uniform over 7
    certain = np.full((4, 5), -1e9)
    certain[np.arange(3), ids[1:]] = 0.0
    assert perplexity(certain, ids) == pytest.approx(1.0)
    probs = np.array([[0.5, 0.5, 0, 0], [0, 0.25, 0.75, 0], [0, 0, 0, 1.0], [1, 0, 0, 0]])
    assert perplexity(np.log(probs + 1e-300), ids) == pytest.approx((0.5 * 0.75 * 1.0) ** (-1 / 3))
    with pytest.raises(ValueError, match="2 or more"):
        perplexity(np.zeros((1, 3)), [0])


def test_quality_text_is_the_summaries_passages():
    from specedge.bench.baselines import QUALITY_TOKENS, quality_text_ids

    class Words:
        def encode(self, text):
            return list(range(len(text.split())))

    prompts = load_prompts()
    ids = quality_text_ids(Words(), prompts)
    assert len(ids) == QUALITY_TOKENS  # the passages hold more words than that
    with pytest.raises(ValueError, match="summarize"):
        quality_text_ids(Words(), [p for p in prompts if p["category"] != "summarize"])


def test_transformers_systems_run_plain_and_both_assisted_kinds(tiny_bundle, monkeypatch):
    """The draft as assistant and prompt lookup both go through transformers' assisted
    decoding, and every system generates the requested tokens."""
    from transformers.generation.utils import GenerationMixin

    from specedge.bench.baselines import transformers_systems

    assisted = []
    original = GenerationMixin._assisted_decoding

    def spy(self, *args, **kwargs):
        assisted.append(kwargs.get("assistant_model") is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", spy)
    systems = transformers_systems(tiny_bundle, 9, [3 + i % 20 for i in range(40)])
    assert set(systems) == {"transformers plain", "transformers assisted",
                            "transformers prompt lookup"}
    runs = {name: systems[name]["generate"]([5, 6, 7, 5, 6, 7, 5, 6]) for name in systems}
    assert [run.tokens for run in runs.values()] == [9, 9, 9]
    assert assisted == [True, False]  # plain decoding does not assist itself
    # the decode time starts when the first new tokens arrive: one at a time in plain
    # decoding, possibly several with the first verification of assisted generation
    assert runs["transformers plain"].first_tokens == 1
    for run in runs.values():
        assert 1 <= run.first_tokens <= 9 and run.decode_seconds > 0
    assert all(10 < system["perplexity"] < 1e4 for system in systems.values())


def test_aggregate_uses_ratios_of_sums():
    a = {"tokens_generated": 11, "target_calls": 10, "draft_calls": 20, "drafted_tokens": 20,
         "accepted_tokens": 0, "time_total_s": 2.0, "time_prefill_s": 1.0, "time_draft_s": 0.2,
         "time_target_s": 0.7, "time_model_decode_s": 0.9, "position_tries": [10, 10],
         "position_accepts": [0, 0]}
    b = {**a, "tokens_generated": 31, "accepted_tokens": 20, "position_accepts": [10, 10]}
    row = aggregate([a, b])
    assert row["acceptance_rate"] == 0.5
    assert row["acceptance_per_position"] == [0.5, 0.5]
    assert row["tokens_per_second"] == (11 + 31 - 2) / 2.0
    assert row["tokens_per_target_call"] == 40 / 20
    assert row["outside_model_share"] == pytest.approx(0.1)


def test_bench_runs_on_another_backend(own_tiny_bundle, tmp_path):
    """--backend: the GPU backends' code path (here host-emulated) runs every configuration."""
    out = tmp_path / "bench"
    main(["bench", "--bundle", str(own_tiny_bundle), "--limit", "1", "--max-new-tokens", "6",
          "--ks", "2", "--baselines", "--backend", "host-emulated", "--out", str(out)])
    results = json.loads((out / "bench.json").read_text())
    assert results["backend"] == "host-emulated"
    assert results["configurations"]["sampled/draft K=2"]["tokens_per_second"] > 0
    # Without --store-auto-k the bundle is left as it was: a one-prompt run sets no K.
    assert results["auto_k"] is None and not (own_tiny_bundle / "auto_k.json").exists()


@pytest.mark.parametrize(("crashes", "n_batch"), [(True, 1), (False, 512)])
def test_llama_cpp_batch_probe_survives_a_crash(tmp_path, monkeypatch, crashes, n_batch):
    # On some CPUs llama.cpp's multi-token batches kill the process: the bench probes them
    # in a child (here a stand-in llama_cpp module that aborts) and falls back to n_batch 1.
    from specedge.bench import baselines

    (tmp_path / "llama_cpp.py").write_text(
        "import os\n\n\nclass Llama:\n    def __init__(self, **kwargs):\n        pass\n\n"
        "    def tokenize(self, text):\n        return [1, 2, 3]\n\n"
        f"    def eval(self, ids):\n        {'os.abort()' if crashes else 'pass'}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert baselines._llama_cpp_batch(tmp_path / "model.gguf", 2) == n_batch


def test_llama_cpp_is_compared_plain_and_with_its_prompt_lookup(monkeypatch):
    """Both llama.cpp systems are listed; without llama-cpp-python both say how to get it."""
    import importlib.util

    from specedge.bench import baselines

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    systems = baselines.llama_cpp_systems(None, 8, 1, [1, 2, 3])
    assert set(systems) == {"llama.cpp plain", "llama.cpp prompt lookup"}
    assert all("install_llama_cpp.sh" in s["skipped"] for s in systems.values())
