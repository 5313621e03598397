"""scripts/experiments/bench_serve.py: its timings and prompt choice, and the whole script on
the tiny bundle (`specedge serve` and the in-process Generator measured and reported,
llama.cpp left out). No timing is asserted: only that every figure is there, positive and
consistent."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))

import bench_serve  # noqa: E402
from bench_serve import (  # noqa: E402
    BATCH_PLAIN,
    BATCH_SPEC,
    IN_PLAIN,
    IN_SPEC,
    PLAIN,
    SPEC,
    Answer,
    Run,
    import_error,
    main,
    select_prompts,
    worst_request_itl,
)

TOP_FIELDS = {"machine", "date", "git_commit", "command", "bundle", "precision", "threads",
              "rounds", "concurrency", "prompts", "prompt_indices", "prompt_categories",
              "max_tokens", "greedy", "stream", "systems", "ratios", "llama_cpp",
              "prompt_tokens_first", "load_average", "max_batch", "unique_prompts"}


def test_answer_timings():
    a = Answer(arrivals=[0.5, 0.6, 0.8, 0.9], tokens=7)
    assert a.ttft == 0.5
    assert a.gaps == pytest.approx([0.1, 0.2, 0.1])
    assert a.tpot == pytest.approx(0.4 / 6)
    assert Answer(arrivals=[0.5], tokens=1).tpot is None and Answer().ttft is None


def test_the_worst_request_is_each_request_against_its_own_prompt_alone():
    """Request i of a batch run pairs with prompt i mod n of the run one at a time; the
    figure is the largest ratio of their inter-token p99s, not the pooled gaps' ratio."""
    alone = Run(1.0, [Answer(arrivals=[0, 0.01, 0.02]), Answer(arrivals=[0, 0.1, 0.2])])
    batch = Run(1.0, [Answer(arrivals=[0, 0.03, 0.06]), Answer(arrivals=[0, 0.1, 0.2]),
                      Answer(arrivals=[0, 0.02, 0.04]),
                      Answer(arrivals=[0, 0.5], error="HTTP 500")])
    # Prompt 0: 30 ms gaps against its 10 ms alone (3x); pooled, the batch's p99 (100 ms)
    # is no longer than alone's and would hide it.
    assert worst_request_itl(batch, alone) == pytest.approx(3.0)
    assert worst_request_itl(Run(1.0, [Answer(arrivals=[0])]), alone) is None


def test_prompts_spread_over_the_categories():
    prompts = select_prompts(4)
    assert len({p["category"] for p in prompts}) >= 3
    assert [p["index"] for p in prompts] == sorted({p["index"] for p in prompts})


def test_a_module_that_does_not_import_says_why():
    assert import_error("json") is None
    assert "specedge_no_such_module" in import_error("specedge_no_such_module")


def test_script_on_the_tiny_bundle(tiny_bundle, tmp_path, capsys):
    out = tmp_path / "serve.json"
    max_tokens = 8
    main(["--bundle", str(tiny_bundle), "--no-llama-cpp", "--rounds", "2", "--concurrency",
          "1", "2", "--prompts", "3", "--max-tokens", str(max_tokens), "--threads", "1",
          "--out", str(out)])
    results = json.loads(out.read_text())
    printed = capsys.readouterr().out

    assert set(results) == TOP_FIELDS
    assert results["max_batch"] == 0  # no batching server unless asked
    assert results["unique_prompts"] is False  # every round asks the same prompts
    assert results["machine"]["cpu"] and results["machine"]["cores"] >= 1
    assert datetime.datetime.fromisoformat(results["date"]).tzinfo is not None
    assert "--no-llama-cpp" in results["command"]
    assert (results["rounds"], results["concurrency"], results["prompts"]) == (2, [1, 2], 3)
    assert results["llama_cpp"] == {"skipped": "--no-llama-cpp"}
    assert "llama.cpp server skipped: --no-llama-cpp" in printed
    # The server and the Generator see the same prompt tokens.
    counts = results["prompt_tokens_first"]
    assert counts[SPEC] == counts["in-process"] > 0

    systems = results["systems"]
    assert list(systems) == [SPEC, PLAIN, IN_SPEC, IN_PLAIN]
    assert set(systems[SPEC]) == set(systems[PLAIN]) == {"1", "2"}
    assert set(systems[IN_SPEC]) == set(systems[IN_PLAIN]) == {"1"}
    for name, by_c in systems.items():
        for c, row in by_c.items():
            assert row["errors"] == 0, row.get("first_error")
            assert row["requests"] == 2 * 3  # two rounds of three prompts
            assert 0 < row["completion_tokens"] <= row["requests"] * max_tokens
            assert sum(row["finish_reasons"].values()) == row["requests"]
            assert set(row["finish_reasons"]) <= {"length", "stop"}
            assert row["requests_per_second"] > 0 and row["tokens_per_second"] > 0
            assert len(row["rounds"]) == 2
            for key in ("ttft_ms", "itl_ms", "tpot_ms"):
                assert 0 < row[key]["p50"] <= row[key]["p99"], (name, c, key)
            assert row["tokens_per_target_call"] >= 1
            cells = f"| {name} | {c} | {row['requests_per_second']:.2f} | " \
                    f"{row['tokens_per_second']:.1f} | {row['ttft_ms']['p50']:.1f} |"
            assert cells in printed
    # Plain decoding makes one target call a token.
    assert systems[PLAIN]["1"]["tokens_per_target_call"] == pytest.approx(1.0)

    quoted = {(r["ratio"], r["concurrency"]): r for r in results["ratios"]}
    assert set(quoted) == {(f"{SPEC} / {PLAIN} tok/s", 1), (f"{SPEC} / {PLAIN} tok/s", 2),
                           (f"{SPEC} / {IN_SPEC} tok/s", 1),
                           (f"{PLAIN} / {IN_PLAIN} tok/s", 1)}
    for (name, c), r in quoted.items():
        assert len(r["rounds"]) == 2 and r["median"] > 0
        lo, hi = r["ci95"]
        assert lo <= r["median"] <= hi
        assert f"| {name} | {c} | {r['median']:.3f} | {lo:.2f}–{hi:.2f} |" in printed
    assert quoted[f"{SPEC} / {IN_SPEC} tok/s", 1]["goal"] == ">= 0.95"


def test_a_bad_bundle_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--bundle", str(tmp_path), "--no-llama-cpp", "--out", str(tmp_path / "x.json")])
    assert "not a bundle" in capsys.readouterr().err


def test_quick_mode_settings(monkeypatch, tmp_path):
    seen = {}

    def measure(bundle, gguf, threads, rounds, concurrency, prompts, max_tokens, cache, llama,
                max_batch, llama_server, unique):
        seen.update(rounds=rounds, concurrency=concurrency, prompts=len(prompts),
                    max_batch=max_batch, llama_server=llama_server, unique=unique)
        return {"systems": {}, "ratios": [], "llama_cpp": {"skipped": "test"},
                "prompt_tokens_first": {}}

    monkeypatch.setattr(bench_serve, "measure", measure)
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    main(["--bundle", str(bundle), "--quick", "--out", str(tmp_path / "q.json")])
    assert seen == {"rounds": 1, "concurrency": [1, 4], "prompts": 4, "max_batch": 0,
                    "llama_server": None, "unique": False}
    # With --max-batch, llama.cpp's own server with as many slots, where one is named.
    binary = tmp_path / "llama-server"
    main(["--bundle", str(bundle), "--quick", "--max-batch", "4", "--llama-server",
          str(binary), "--out", str(tmp_path / "q.json")])
    assert seen["max_batch"] == 4 and seen["llama_server"] == binary
    main(["--bundle", str(bundle), "--quick", "--unique-prompts", "--out",
          str(tmp_path / "q.json")])
    assert seen["unique"] is True


def test_unique_prompts_give_every_request_a_message_of_its_own():
    """Each request's message starts with a tag of its own: no two messages of a run, or of
    two runs, are alike, and each ends with its prompt."""
    prompts = ["why is the sky blue?", "why is the sky blue?", "summarize: a text"]
    first, second = bench_serve.tagged(prompts, "0.1"), bench_serve.tagged(prompts, "0.2")
    assert len(set(first + second)) == 6
    assert all(t.endswith(p) for t, p in zip(first, prompts))


def test_llama_server_runs_with_parallel_slots_and_its_ngram_mode(monkeypatch, tmp_path):
    """llama-server's command: --max-batch slots with continuous batching, each slot the
    context llama-cpp-python's server gets, flash attention; its n-gram speculation with
    llama-cpp-python's prompt-lookup sizes."""
    commands = []

    class Started:
        def __init__(self, name, command, port, ready, log):
            commands.append(command)
            self.name = name

    monkeypatch.setattr(bench_serve, "ServerProcess", Started)
    gguf = tmp_path / "m.gguf"
    plain = bench_serve.start_llama_server(tmp_path / "llama-server", gguf, 2, tmp_path, 4)
    ngram = bench_serve.start_llama_server(tmp_path / "llama-server", gguf, 2, tmp_path, 4,
                                           ngram=True)
    assert (plain.name, ngram.name) == (bench_serve.LLAMA_SLOTS, bench_serve.LLAMA_SLOTS_NGRAM)
    command = commands[0]
    flags = {a: b for a, b in zip(command, command[1:]) if a.startswith("--")
             and not b.startswith("--")}
    assert flags["--parallel"] == "4" and "--cont-batching" in commands[0]
    assert flags["--ctx-size"] == str(4 * bench_serve.LLAMA_CPP_CONTEXT)
    assert flags["--flash-attn"] == "on"
    assert "--spec-type" not in commands[0]
    extra = commands[1][len(commands[0]):]
    assert extra == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                     "--spec-ngram-simple-size-m", "10"]


def test_batch_mode_adds_a_batching_server(tiny_batched_bundle, tmp_path, capsys):
    """--max-batch 2 starts a second `specedge serve --max-batch 2` on the same batched
    bundle and reports it beside the one-sequence-at-a-time server, with the ratios."""
    out = tmp_path / "batch.json"
    main(["--bundle", str(tiny_batched_bundle), "--no-llama-cpp", "--rounds", "1",
          "--concurrency", "1", "2", "--prompts", "2", "--max-tokens", "6", "--threads", "1",
          "--max-batch", "2", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["max_batch"] == 2
    systems = results["systems"]
    assert {BATCH_SPEC, BATCH_PLAIN} <= set(systems)
    for name in (BATCH_SPEC, BATCH_PLAIN):
        assert set(systems[name]) == {"1", "2"}
        for row in systems[name].values():
            assert row["errors"] == 0, row.get("first_error")
            assert row["tokens_per_second"] > 0
    quoted = {(r["ratio"], r["concurrency"]) for r in results["ratios"]}
    assert {(f"{BATCH_SPEC} / {SPEC} tok/s", 2), (f"{BATCH_PLAIN} / {PLAIN} tok/s", 2),
            (f"{BATCH_SPEC} / {SPEC} at 1 ITL p99", 2),
            (f"{BATCH_SPEC} / {SPEC} at 1 ITL p99, worst request", 2)} <= quoted
    assert f"| {BATCH_SPEC} | 2 |" in capsys.readouterr().out
