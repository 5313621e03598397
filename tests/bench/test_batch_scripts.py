"""scripts/experiments/batch_exactness.py, batch_memory.py, bench_batch_calls.py,
bench_batch_session.py and serve_overhead.py on the tiny batched bundle: the checks and
figures they report are the ones the runtime gives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "experiments"))

import batch_exactness  # noqa: E402
import batch_memory  # noqa: E402
import bench_batch_calls  # noqa: E402
import bench_batch_session  # noqa: E402
import serve_overhead  # noqa: E402

from specedge.runtime import batch  # noqa: E402


def test_batch_exactness_reports_each_sequence_and_the_chunked_prompt(tiny_batched_bundle,
                                                                      tmp_path):
    out = tmp_path / "exact.json"
    report = batch_exactness.main(["--bundle", str(tiny_batched_bundle), "--prompts", "5",
                                   "--tokens", "12", "--max-batch", "3", "--threads", "1",
                                   "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [r["settings"] for r in report["rows"]] == batch_exactness.SETTINGS
    assert report["all_same"] and all(r["same"] and r["parts_at"] is None
                                      for r in report["rows"])
    assert report["chunked_prefill_same"] is True
    assert report["rows"][0]["drafted"] == 0 and report["rows"][2]["drafted"] > 0


def test_bench_batch_calls_times_each_shape(tiny_batched_bundle, tmp_path, capsys):
    out = tmp_path / "calls.json"
    report = bench_batch_calls.main(["--bundle", str(tiny_batched_bundle), "--shapes", "1x2",
                                     "3x1", "2x3", "--rounds", "2", "--calls", "2",
                                     "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    shapes = [(s["rows"], s["tokens"]) for s in report["shapes"]]
    assert shapes == [(1, 2), (3, 1), (2, 3)]
    assert report["shapes"][0]["ratio"] == 1.0
    assert all(s["ms"] > 0 and len(s["rounds_ms"]) == 2 for s in report["shapes"])
    assert "| 3 x 1 |" in capsys.readouterr().out


def test_bench_batch_session_takes_each_setting_in_turn(tiny_batched_bundle, tmp_path, capsys):
    from specedge.runtime.kv_cache import SlotCaches

    out = tmp_path / "session.json"
    before = batch.PREFILL_CHUNK, SlotCaches.step
    report = bench_batch_session.main(["--bundle", str(tiny_batched_bundle), "--concurrency",
                                       "2", "--chunks", "8", "16", "--growth-steps", "32",
                                       "--prompts", "3", "--tokens", "6", "--rounds", "2",
                                       "--threads", "1", "--distinct", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [(a["batch"], a["chunk"], a["growth_step"]) for a in report["arms"]] == \
        [("work", 8, 32), ("work", 16, 32)]
    assert [a["target_chunk"] for a in report["arms"]] == [8, 16]  # each session's own
    assert report["arms"][0]["ratio"] == 1.0
    assert all(len(a["tokens_per_second"]) == 2 and a["itl_p99_ms"] >= a["itl_p50_ms"] > 0
               and a["ttft_p50_ms"] > 0 for a in report["arms"])
    assert set(report["arms"][1]["ratios"]) == {"tokens_per_second", "itl_p99",
                                                "worst_request_itl_p99", "ttft_p50",
                                                "ttft_p90"}
    assert all(len(c["rounds"]) == 2 for c in report["arms"][1]["ratios"].values())
    assert (batch.PREFILL_CHUNK, SlotCaches.step) == before
    assert "| work | 16 | 32 |" in capsys.readouterr().out


def test_bench_batch_session_runs_the_batch_module_of_a_revision_beside_this_one(
        tiny_batched_bundle, tmp_path):
    """--base HEAD: the committed runtime/batch.py, loaded as a module of its own, is the
    first arm; both serve every round (a warm-up round first)."""
    report = bench_batch_session.main(["--bundle", str(tiny_batched_bundle), "--concurrency",
                                       "2", "--base", "HEAD", "--prompts", "2", "--tokens",
                                       "4", "--rounds", "2", "--threads", "1", "--out",
                                       str(tmp_path / "ab.json")])
    assert [a["batch"] for a in report["arms"]] == ["HEAD", "work"]
    assert all(len(a["tokens_per_second"]) == 2 for a in report["arms"])
    assert report["arms"][1]["ratios"]["tokens_per_second"]["ci95"] is not None


def test_serve_overhead_counts_the_same_tokens_in_process_and_through_the_server(
        tiny_batched_bundle, tmp_path, capsys):
    """64 tokens an answer: long enough that two answers overlap (and their calls meet)
    also when the second thread starts late on a busy machine, as 8 did not, and 32 did not
    once: a prompt of more than 256 tokens (the third, 411 on the tiny tokenizer) is read
    in 51 chunks beside the other's steps, more than 32 of them."""
    out = tmp_path / "overhead.json"
    report = serve_overhead.main(["--bundle", str(tiny_batched_bundle), "--max-batch", "2",
                                  "--concurrency", "2", "--prompts", "3", "--tokens", "64",
                                  "--rounds", "2", "--threads", "1", "--switch-intervals",
                                  "0.001", "--calls", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    systems = [row["system"] for row in report["rows"]]
    assert systems == ["in-process", "server whole", "server streamed",
                       "server switch 1 ms whole", "server switch 1 ms streamed"]
    # Greedy, the same prompts: every system decodes the same number of tokens each round.
    counts = {run["tokens"] for runs in report["runs"].values() for run in runs}
    assert len(counts) == 1 and counts.pop() > 0
    assert report["rows"][0]["ratio_to_in_process"] == 1.0
    assert all(row["server_cpu_per_token_ms"] > 0 for row in report["rows"][1:])
    calls = report["calls"]["calls"]
    assert any(kind.startswith("target prompt chunk") for kind in calls)
    assert any(kind.startswith("target 2 rows x") for kind in calls)
    assert "model calls" in capsys.readouterr().out


def test_batch_memory_serves_waves_of_new_shapes(tiny_batched_bundle, tmp_path, capsys):
    waves = [batch_memory.wave_requests(w, 3, 16) for w in range(3)]
    for a, b in zip(waves, waves[1:]):  # each wave other prompts and answer lengths
        assert [r.messages for r in a] != [r.messages for r in b]
        assert [r.config.max_new_tokens for r in a] != [r.config.max_new_tokens for r in b]
    assert all(8 <= r.config.max_new_tokens <= 16 for w in waves for r in w)
    out = tmp_path / "memory.json"
    report = batch_memory.main(["--bundle", str(tiny_batched_bundle), "--max-batch", "2", "3",
                                "--waves", "2", "--tokens", "8", "--threads", "1",
                                "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [r["max_batch"] for r in report["runs"]] == [2, 3]
    for run in report["runs"]:
        assert [w["after"] for w in run["waves"]] == ["load", "wave 1", "wave 2"]
        asked = [sum(r.config.max_new_tokens for r in batch_memory.wave_requests(
            w, run["max_batch"], 8)) for w in range(2)]
        for wave, most in zip(run["waves"][1:], asked):
            assert 0 < wave["tokens"] <= most and wave["rss_mb"] > 0
    assert "| 3 |" in capsys.readouterr().out
