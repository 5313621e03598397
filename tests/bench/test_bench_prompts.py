"""`specedge bench --prompts FILE` and `--quick`: users' own prompts (strings or chat
messages, in their own categories), each bad line named by file and line, and the quick
plain-against-defaults comparison."""

from __future__ import annotations

import json

import pytest

from specedge.bench.configs import (
    NO_DRAFT_QUICK,
    geometric_mean,
    per_prompt_speedups,
    quick_configurations,
)
from specedge.cli import main
from specedge.export.bundle_writer import export_bundle
from specedge.prompts import DEFAULT_CATEGORY, prompt_input, read_prompt_file
from specedge.runtime.config import GenerationConfig

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Why is the sky blue?"}]


def write_lines(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_file_reads_prompts_and_messages(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"category": "support", "prompt": "Reset my password", "id": 7}),
        "",
        json.dumps({"category": "chat", "messages": MESSAGES}),
        json.dumps({"prompt": "no category"}),
    ])
    prompts = read_prompt_file(path)
    assert prompts == [
        {"category": "support", "prompt": "Reset my password", "line": 1},  # "id" ignored
        {"category": "chat", "messages": MESSAGES, "line": 3},
        {"category": DEFAULT_CATEGORY, "prompt": "no category", "line": 4},
    ]
    assert DEFAULT_CATEGORY == "custom"
    assert prompt_input(prompts[0]) == {"prompt": "Reset my password"}
    assert prompt_input(prompts[1]) == {"messages": MESSAGES}


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "not JSON"),
    ('["a", "list"]', "expected a JSON object with 'prompt' or 'messages', got an array"),
    ('"just a string"', "got a string"),
    ('{"category": "chat"}', "neither 'prompt' nor 'messages'"),
    (json.dumps({"prompt": "hi", "messages": MESSAGES}), "both 'prompt' and 'messages'"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"prompt": 3}', "'prompt' must be a string, got a number"),
    ('{"messages": []}', "non-empty array"),
    ('{"messages": "hello"}', "non-empty array"),
    ('{"messages": ["hello"]}', "messages[0] must be an object"),
    ('{"messages": [{"role": "user"}]}', "messages[0] needs a string 'content', got nothing"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]}',
     "messages[1] needs a string 'role', got a number"),
    ('{"messages": [{"role": "user", "content": " "}]}', "'content' is empty"),
    ('{"category": "", "prompt": "hi"}', "'category' must be a non-empty string"),
    ('{"category": 5, "prompt": "hi"}', "'category' must be a non-empty string"),
])
def test_each_bad_line_is_named_with_its_line_number(tmp_path, bad, message):
    good = json.dumps({"prompt": "fine"})
    path = write_lines(tmp_path / "p.jsonl", [good, "", good, bad, good])
    with pytest.raises(ValueError) as info:
        read_prompt_file(path)
    assert str(info.value).startswith(f"{path} line 4: ")
    assert message in str(info.value)


def test_missing_and_empty_prompt_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_prompt_file(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompt_file(write_lines(tmp_path / "blank.jsonl", ["", "  "]))


def test_quick_compares_plain_with_the_runtime_defaults():
    """The default configuration passes no drafting setting, so it measures exactly what
    `Generator.generate` does when a user sets none."""
    (plain, plain_kwargs), (default, default_kwargs) = quick_configurations(has_draft=True)
    assert (plain, default) == ("greedy/plain", "greedy/default")
    assert plain_kwargs == {"use_draft": False} and default_kwargs == {}
    config, runtime = GenerationConfig.of(**default_kwargs), GenerationConfig()
    assert (config.use_draft, config.drafter, config.draft_tokens) == (
        runtime.use_draft, runtime.drafter, runtime.draft_tokens)
    assert config.sampling.greedy


def test_per_prompt_speedups_and_their_geometric_mean():
    def stats(tokens, seconds):  # one generation: prefill 1 s, the rest decode
        return {"tokens_generated": tokens, "time_total_s": 1.0 + seconds,
                "time_prefill_s": 1.0, "target_calls": tokens, "draft_calls": 0,
                "drafted_tokens": 0, "accepted_tokens": 0, "time_draft_s": 0.0,
                "time_target_s": seconds, "time_model_decode_s": seconds,
                "position_tries": [], "position_accepts": []}

    plain = [stats(11, 2.0), stats(11, 1.0), stats(1, 0.0)]
    fast = [stats(11, 1.0), stats(11, 2.0), stats(1, 0.0)]
    speedups = per_prompt_speedups(fast, plain)
    assert speedups == [pytest.approx(2.0), pytest.approx(0.5), None]  # nothing decoded
    assert geometric_mean(speedups) == pytest.approx(1.0)
    assert geometric_mean([None]) is None


def test_quick_bench_on_a_prompt_file_reports_its_categories(own_tiny_bundle, tmp_path, capsys):
    prompts = write_lines(tmp_path / "mine.jsonl", [
        json.dumps({"category": "support chat", "messages": MESSAGES}),
        json.dumps({"category": "extraction", "prompt": "List the colours: red, blue."}),
    ])
    out = tmp_path / "bench"
    main(["bench", "--bundle", str(own_tiny_bundle), "--prompts", str(prompts), "--quick",
          "--baselines", "--max-new-tokens", "8", "--out", str(out)])
    results = json.loads((out / "bench.json").read_text())
    configs = results["configurations"]
    assert list(configs) == ["greedy/plain", "greedy/default"]
    assert results["quick"] and "systems" not in results
    assert results["prompt_file"] == str(prompts) and results["prompts"] == 2
    assert results["categories"] == {"extraction": 1, "support chat": 1}
    for row in configs.values():
        assert set(row["by_category"]) == {"extraction", "support chat"}
        assert row["tokens_per_second"] > 0 and len(row["speedup_per_prompt"]) == 2
    assert configs["greedy/plain"]["speedup"] == 1.0
    assert configs["greedy/default"]["speedup"] > 0
    assert configs["greedy/default"]["speedup_geomean"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]  # no plots
    markdown = (out / "bench.md").read_text()
    assert capsys.readouterr().out.strip() == markdown.strip()  # also printed
    assert "| configuration | extraction | support chat |" in markdown
    assert "| greedy/default |" in markdown and "draft K=" not in markdown
    assert "Speedup of the default settings over plain decoding" in markdown
    assert "geometric mean of 2 per-prompt speedups" in markdown
    assert "## Systems" not in markdown


def test_messages_reach_the_generator_as_messages(own_tiny_bundle, tmp_path, monkeypatch):
    """A `messages` prompt is generated from its whole conversation (system turn included),
    not from its last message alone."""
    from specedge.runtime import Generator

    seen = []
    original = Generator.generate

    def spy(self, prompt=None, **kwargs):
        seen.append((prompt, kwargs.get("messages")))
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Generator, "generate", spy)
    prompts = write_lines(tmp_path / "mine.jsonl", [
        json.dumps({"messages": MESSAGES}), json.dumps({"prompt": "Hello"})])
    main(["bench", "--bundle", str(own_tiny_bundle), "--prompts", str(prompts), "--quick",
          "--max-new-tokens", "4", "--out", str(tmp_path / "bench")])
    # warm-up (2 configurations on the first prompt), then 2 prompts x 2 configurations
    assert seen == [(None, MESSAGES)] * 4 + [("Hello", None)] * 2


def test_bench_with_a_bad_prompt_file_exits_2_with_one_line(own_tiny_bundle, tmp_path, capsys):
    prompts = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok"}),
                                                   '{"category": "chat"}'])
    with pytest.raises(SystemExit) as info:
        main(["bench", "--bundle", str(own_tiny_bundle), "--prompts", str(prompts), "--quick",
              "--out", str(tmp_path / "bench")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{prompts} line 2: has neither 'prompt' nor 'messages'" in err
    assert not (tmp_path / "bench").exists()


def test_a_prompt_too_long_for_the_bundle_is_named_before_timing(own_tiny_bundle, tmp_path,
                                                                  capsys):
    prompts = write_lines(tmp_path / "long.jsonl", [json.dumps({"prompt": "ok"}),
                                                    json.dumps({"prompt": "word " * 5000})])
    with pytest.raises(SystemExit) as info:
        main(["bench", "--bundle", str(own_tiny_bundle), "--prompts", str(prompts), "--quick",
              "--out", str(tmp_path / "bench")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{prompts} line 2: the prompt's" in err and "--max-new-tokens" in err


def test_quick_on_a_bundle_without_draft_measures_prompt_lookup(tiny_checkpoints, tmp_path,
                                                                capsys):
    """The runtime's defaults need a draft model: without one, --quick says so and measures
    prompt lookup, which needs none, instead of failing."""
    bundle = tmp_path / "no-draft"
    export_bundle(str(tiny_checkpoints["llama"]), bundle)
    capsys.readouterr()
    prompts = write_lines(tmp_path / "mine.jsonl", [json.dumps({"prompt": "Hello there"})])
    out = tmp_path / "bench"
    main(["bench", "--bundle", str(bundle), "--prompts", str(prompts), "--quick",
          "--max-new-tokens", "6", "--out", str(out)])
    captured = capsys.readouterr()
    assert NO_DRAFT_QUICK in captured.err
    configs = json.loads((out / "bench.json").read_text())["configurations"]
    assert list(configs) == ["greedy/plain", "greedy/prompt-lookup auto"]
    assert "Speedup of greedy/prompt-lookup auto (the bundle has no draft model)" in \
        captured.out
