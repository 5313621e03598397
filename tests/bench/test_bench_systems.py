"""The system comparison of `specedge bench`: rounds, turns, end-to-end and decode speeds,
ratios to llama.cpp with their confidence intervals, and the report, on stand-in systems
driven by a fake clock, so that every figure is known exactly."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from specedge.bench import baselines, report
from specedge.bench.baselines import Generation, system_ratios, time_systems
from specedge.bench.intervals import ratio_ci
from specedge.bench.run import BASELINES, _ours, add_arguments
from specedge.cli import main


class FakeClock:
    """Stands in for the `time` module in baselines.py: time moves only when a stand-in
    system says it spends some."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(baselines, "time", fake)
    return fake


def system(clock: FakeClock, prompts: int, tokens: int, first_s: float,
           decode: list[float], first_tokens: int = 1, calls: list | None = None) -> dict:
    """A system that spends `first_s` seconds to its first `first_tokens` tokens, then
    decodes the rest at decode[r] tokens per second in round r (the warm-up runs at round
    0's speed and is not counted)."""
    done = [-1]  # generations so far, the warm-up being -1

    def generate(ids: list[int]) -> Generation:
        r = max(0, done[0]) // prompts
        done[0] += 1
        if calls is not None:
            calls.append(ids[0])
        decode_s = (tokens - first_tokens) / decode[r]
        clock.spend(first_s + decode_s)
        return Generation(tokens, decode_s, first_tokens)

    return {"generate": generate, "perplexity": 2.0}


def test_rounds_repeat_the_prompts_with_the_first_system_rotating_across_rounds():
    calls = []

    def named(name):
        def generate(ids):
            calls.append((name, ids[0]))
            return Generation(4, 0.5)
        return {"generate": generate}

    systems = {"a": named("a"), "b": named("b"), "c": {"skipped": "not installed"}}
    results = time_systems(systems, [[0], [1], [2]], rounds=2)
    assert calls == [("a", 0), ("b", 0),                                      # warm-up
                     ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2),  # round 1
                     ("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2)]  # round 2
    assert [r["tokens"] for r in results["a"]["rounds"]] == [12, 12]
    assert results["c"] == {"skipped": "not installed"}
    with pytest.raises(ValueError, match="rounds must be 1 or more"):
        time_systems(systems, [[0]], rounds=0)


def test_end_to_end_and_decode_speeds_per_round(clock):
    """9 tokens a prompt, the first after 1 s: decode counts the 8 after it over the time
    after it, end to end all 9 over the whole call."""
    systems = {"x": system(clock, 2, 9, 1.0, [4.0, 2.0, 8.0]),
               "y": system(clock, 2, 9, 0.5, [8.0, 8.0, 8.0], first_tokens=3)}
    results = time_systems(systems, [[1], [2]], rounds=3)
    x = results["x"]
    assert [r["decode_tokens_per_second"] for r in x["rounds"]] == [4.0, 2.0, 8.0]
    assert [r["decode_tokens"] for r in x["rounds"]] == [16, 16, 16]
    # end to end: 18 tokens over 2 * (1 s + 8 tokens / speed)
    assert [r["tokens_per_second"] for r in x["rounds"]] == pytest.approx(
        [18 / 6.0, 18 / 10.0, 18 / 4.0])
    assert x["decode_tokens_per_second"] == 4.0  # medians over rounds
    assert x["tokens_per_second"] == pytest.approx(18 / 6.0)
    assert x["perplexity"] == 2.0 and "generate" not in x
    # three tokens arrive together first: the 6 after them decode at 8 tok/s
    y = results["y"]
    assert y["decode_tokens_per_second"] == 8.0
    assert y["tokens_per_second"] == pytest.approx(18 / (2 * (0.5 + 6 / 8.0)))


def test_a_system_that_returns_a_bare_count_is_refused():
    with pytest.raises(TypeError, match="baselines.Generation"):
        time_systems({"old": {"generate": lambda ids: 5}}, [[1]])


def test_our_configurations_report_the_runtimes_decode_time():
    """specedge's decode time is the runtime's own (total minus prefill), not re-timed."""
    class Result:
        stats = {"tokens_generated": 12, "time_total_s": 3.0, "time_prefill_s": 0.75}

    class Gen:
        def generate(self, **kwargs):
            assert kwargs == {"prompt_ids": [7, 8], "max_new_tokens": 12, "use_draft": False}
            return Result()

    ours = _ours(Gen(), {"use_draft": False}, 12, 3.5)
    assert ours["perplexity"] == 3.5
    assert ours["generate"]([7, 8]) == Generation(12, 2.25, 1)


def measured(decode: list[float | None], end_to_end: list[float]) -> dict:
    """A timed system's result as `time_systems` gives it, from its speeds per round."""
    return {"rounds": [{"decode_tokens_per_second": d, "tokens_per_second": e}
                       for d, e in zip(decode, end_to_end, strict=True)],
            "decode_tokens_per_second": float(np.median([d for d in decode if d])),
            "tokens_per_second": float(np.median(end_to_end))}


def test_ratios_pair_rounds_and_pick_llama_cpps_faster_system_per_speed():
    systems = {
        "specedge best": measured([10.0, 12.0, 9.0], [8.0, 9.0, 8.0]),
        "specedge plain": measured([6.0, 6.0, 6.0], [5.0, 5.0, 5.0]),
        "transformers plain": {"skipped": "not installed"},
        # lookup decodes faster, plain is faster end to end (its prompt evaluation)
        "llama.cpp plain": measured([4.0, 4.0, 4.0], [4.0, 3.0, 4.0]),
        "llama.cpp prompt lookup": measured([5.0, 5.0, 6.0], [2.0, 2.0, 2.0]),
    }
    quoted = {(r["ratio"], r["speed"]): r for r in system_ratios(systems)}
    assert list(quoted) == [("specedge best / llama.cpp best", "decode"),
                            ("specedge best / llama.cpp best", "end to end"),
                            ("specedge plain / llama.cpp plain", "decode"),
                            ("specedge plain / llama.cpp plain", "end to end")]
    best_decode = quoted["specedge best / llama.cpp best", "decode"]
    assert best_decode["denominator"] == "llama.cpp prompt lookup"
    assert best_decode["rounds"] == [2.0, 2.4, 1.5]  # round by round, not medians
    assert best_decode["median"] == 2.0
    assert best_decode["ci95"] == pytest.approx(ratio_ci([2.0, 2.4, 1.5])["ci95"])
    best_e2e = quoted["specedge best / llama.cpp best", "end to end"]
    assert best_e2e["denominator"] == "llama.cpp plain"
    assert best_e2e["rounds"] == [2.0, 3.0, 2.0]
    plain = quoted["specedge plain / llama.cpp plain", "decode"]
    assert (plain["numerator"], plain["denominator"]) == ("specedge plain", "llama.cpp plain")
    assert plain["rounds"] == [1.5, 1.5, 1.5]


def test_skipped_llama_cpp_gives_no_ratio():
    ours = measured([10.0, 11.0], [8.0, 9.0])
    skipped = {"skipped": "llama-cpp-python not installed"}
    assert system_ratios({"specedge best": ours, "specedge plain": ours,
                          "llama.cpp plain": skipped, "llama.cpp prompt lookup": skipped}) == []
    assert system_ratios({"specedge best": ours, "specedge plain": ours}) == []
    # only its lookup ran: it is llama.cpp's best, and there is no plain / plain ratio
    lookup = measured([5.0, 5.0], [4.0, 4.0])
    quoted = system_ratios({"specedge best": ours, "specedge plain": ours,
                            "llama.cpp plain": skipped, "llama.cpp prompt lookup": lookup})
    assert {(r["ratio"], r["denominator"]) for r in quoted} == {
        ("specedge best / llama.cpp best", "llama.cpp prompt lookup")}
    assert [r["rounds"] for r in quoted] == [[2.0, 2.2], [2.0, 2.25]]


def test_a_round_without_decode_time_is_left_out_of_the_ratio():
    ours = measured([10.0, 11.0], [8.0, 9.0])
    llama = measured([None, 5.0], [4.0, 4.0])  # round 1: every generation stopped at once
    quoted = system_ratios({"specedge best": ours, "llama.cpp plain": llama})
    assert [(r["speed"], r["rounds"]) for r in quoted] == [("decode", [2.2]),
                                                         ("end to end", [2.0, 2.25])]
    assert quoted[0]["ci95"] is None  # one round: no interval


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--bundle", "b", *argv])


def test_baselines_and_rounds_flags():
    assert parse().baselines == ["transformers", "llama.cpp", "onnxruntime-genai",
                                 "openvino-genai"] == list(BASELINES)
    assert parse("--baselines").baselines == []
    assert parse("--baselines", "llama.cpp").baselines == ["llama.cpp"]
    assert parse("--baselines", "onnxruntime-genai").baselines == ["onnxruntime-genai"]
    assert parse("--baselines", "llama.cpp", "transformers").baselines == [
        "llama.cpp", "transformers"]
    assert parse().rounds == 3 and parse("--rounds", "9").rounds == 9


@pytest.mark.parametrize(("argv", "message"), [
    (["--baselines", "vllm"], "argument --baselines: invalid choice: 'vllm'"),
    (["--rounds", "0"], "argument --rounds: expected a whole number of 1 or more, got '0'"),
    (["--rounds", "two"], "argument --rounds: expected a whole number of 1 or more"),
    (["--no-baselines"], "unrecognized arguments: --no-baselines")])
def test_bad_bench_flags_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--bundle", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def stand_in_llama_cpp(monkeypatch, clock: FakeClock, prompt_s: float, step_s: float) -> list:
    """llama_cpp as llama_cpp_systems drives it: evaluating the prompt takes prompt_s
    before the first token is yielded, every later token step_s."""
    made = []

    class Llama:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            made.append(self)

        def eval(self, ids):
            self.scores = np.zeros((len(ids), 7))

        def reset(self):
            pass

        def generate(self, ids, **kwargs):
            assert kwargs == {"top_k": 1, "top_p": 1.0, "temp": 0.0, "reset": True}
            clock.spend(prompt_s)
            while True:
                yield 3
                clock.spend(step_s)

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = Llama
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | "
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda num_pred_tokens: ("lookup", num_pred_tokens)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(baselines, "_llama_cpp_batch", lambda path, threads: 512)
    return made


def test_llama_cpp_decode_time_starts_at_its_first_token(tmp_path, clock, monkeypatch):
    made = stand_in_llama_cpp(monkeypatch, clock, prompt_s=2.0, step_s=0.25)
    systems = baselines.llama_cpp_systems(tmp_path / "m.gguf", 9, 2, [1, 2, 3, 4])
    assert set(systems) == {"llama.cpp plain", "llama.cpp prompt lookup"}
    assert made[-1].kwargs["draft_model"] == ("lookup", baselines.LLAMA_CPP_LOOKUP_TOKENS)
    for row in systems.values():
        assert row["build"] == "CPU : AVX2 = 1 |" and row["n_batch"] == 512
        start = clock.now
        assert row["generate"]([5, 6]) == Generation(9, 8 * 0.25, 1)
        assert clock.now - start == 2.0 + 8 * 0.25
    results = time_systems(systems, [[5, 6]], rounds=2)
    for row in results.values():
        assert row["decode_tokens_per_second"] == 4.0
        assert row["tokens_per_second"] == pytest.approx(9 / 4.0)


SAMPLE = {"bundle": "b", "prompts": 2, "prompt_file": None, "max_new_tokens": 9,
          "precision": "int4", "quick": False, "categories": {},
          "configurations": {}, "systems_prompts": 2, "systems_rounds": 3,
          "quality_tokens": 512}


def timed(clock: FakeClock, decode: list[float], **extra) -> dict:
    """9 tokens on each of 2 prompts, the first after 1 s, then decode[r] tok/s."""
    return {**system(clock, 2, 9, 1.0, decode), **extra}


def test_report_of_a_run_against_llama_cpp(clock):
    build = {"build": "CPU : AVX2 = 1 | FMA = 1 |", "n_batch": 512, "flash_attn": True}
    systems = {"specedge plain": timed(clock, [8.0, 8.0, 8.0]),
               "specedge best": timed(clock, [16.0, 12.0, 20.0],
                                      configuration="greedy/draft K=2"),
               "llama.cpp plain": timed(clock, [10.0, 8.0, 8.0], **build),
               "llama.cpp prompt lookup": timed(clock, [8.0, 9.0, 10.0], **build)}
    results = time_systems(systems, [[1], [2]], rounds=3)
    run = {**SAMPLE, "systems": results, "system_ratios": system_ratios(results)}
    json.dumps(run)  # the results JSON holds them as they are
    text = "\n".join(report._systems_markdown(run))
    assert "## Systems (greedy, first 2 prompts, 3 rounds)" in text
    # end to end per round: 18 tokens over 2 * (1 s + 8 tokens at 16, 12, 20 tok/s)
    assert "| specedge best | 6.0 | 16.0 | 2.00 | 6.0 5.4 6.4 |" in text
    # llama.cpp's best: its lookup by median (9 against 8 tok/s), though plain won round 1
    assert ("| specedge best / llama.cpp best (llama.cpp prompt lookup) | decode | 2.00x | "
            in text)
    assert "| 2.00 1.33 2.00 |" in text
    assert "| specedge plain / llama.cpp plain | decode | 1.00x | 0.67–1.28x | 0.80 1.00 1.00 |" \
        in text
    assert text.count("CPU : AVX2 = 1 | FMA = 1 |") == 1
    assert text.rstrip().endswith("its build: `CPU : AVX2 = 1 | FMA = 1 |`")


def test_report_says_why_there_is_no_ratio(clock):
    systems = {"specedge plain": timed(clock, [8.0]),
               "specedge best": timed(clock, [8.0], configuration="greedy/plain")}
    run = {**SAMPLE, "systems_rounds": 1, "systems": time_systems(systems, [[1], [2]])}
    text = "\n".join(report._systems_markdown({**run, "system_ratios": []}))
    assert "first 2 prompts, 1 round)" in text
    assert "No ratio to llama.cpp: it was not among --baselines." in text
    skipped = {"skipped": "llama-cpp-python not installed (bash scripts/install_llama_cpp.sh)"}
    run["systems"].update({"llama.cpp plain": skipped, "llama.cpp prompt lookup": skipped})
    text = "\n".join(report._systems_markdown({**run, "system_ratios": []}))
    assert f"| llama.cpp plain | skipped: {skipped['skipped']} | | | |" in text
    assert "No ratio to llama.cpp: llama.cpp plain: llama-cpp-python not installed" in text
    assert "its build" not in text


def with_perplexity(result: dict, value: float) -> dict:
    return {**result, "perplexity": value}


def test_the_pareto_line_takes_our_fastest_system_at_no_worse_perplexity():
    systems = {
        # our fastest export is also our worst: never compared with a better peer
        "specedge lean default": with_perplexity(measured([30.0, 30.0], [20.0, 20.0]), 25.0),
        "specedge best": with_perplexity(measured([20.0, 24.0], [15.0, 15.0]), 22.0),
        "specedge plain": with_perplexity(measured([12.0, 12.0], [10.0, 10.0]), 22.0),
        "llama.cpp plain": with_perplexity(measured([10.0, 12.0], [10.0, 10.0]), 22.0),
        "onnxruntime-genai plain": with_perplexity(measured([18.0, 18.0], [12.0, 12.0]), 27.0),
        "onnxruntime-genai n-gram": with_perplexity(measured([25.0, 25.0], [14.0, 14.0]),
                                                    27.0),
    }
    line = {(e["denominator"], e["speed"]): e for e in baselines.pareto_ratios(systems)}
    assert list(line) == [("llama.cpp plain", "decode"), ("llama.cpp plain", "end to end"),
                          ("onnxruntime-genai n-gram", "decode"),
                          ("onnxruntime-genai n-gram", "end to end")]
    llama = line["llama.cpp plain", "decode"]  # equal perplexity counts as no worse
    assert llama["numerator"] == "specedge best" and llama["rounds"] == [2.0, 2.0]
    assert (llama["numerator_perplexity"], llama["denominator_perplexity"]) == (22.0, 22.0)
    genai = line["onnxruntime-genai n-gram", "decode"]
    assert genai["numerator"] == "specedge lean default" and genai["rounds"] == [1.2, 1.2]
    # a peer better than all of ours: no ratio, and our lowest perplexity named instead
    systems["llama.cpp plain"]["perplexity"] = 21.5
    llama = baselines.pareto_ratios(systems)[0]
    assert llama["numerator"] is None and "median" not in llama
    assert (llama["lowest"], llama["lowest_perplexity"]) == ("specedge best", 22.0)
    text = "\n".join(report._pareto_markdown(baselines.pareto_ratios(systems)))
    assert ("| llama.cpp plain (21.50) | decode | none: our lowest is specedge best (22.00) "
            "| - | - | - |") in text
    assert ("| onnxruntime-genai n-gram (27.00) | decode | specedge lean default (25.00) | "
            "1.20x |") in text


def test_also_takes_other_bundles_and_checks_them_before_timing(tmp_path, capsys):
    assert parse().also == []
    assert parse("--also", "a", "b").also == [Path("a"), Path("b")]
    for argv, message in [(["--also", str(tmp_path / "nope")], "no bundle there"),
                          (["--also", str(tmp_path), "--quick"], "drop one of them")]:
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--bundle", str(tmp_path), *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
