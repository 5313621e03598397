"""`specedge generate` and `specedge export`: output formats, and bad input as one line.

Bad input must end with exit status 2 and exactly one line on stderr, never a traceback or
a usage dump. Most cases call `specedge.cli.main` in-process (fast); a few go through a
real subprocess (`python -m specedge.cli` or the `specedge` console script) so that output
written outside Python (ONNX Runtime, progress bars) is seen too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny

from specedge.cli import main
from specedge.runtime import Generator
from specedge.runtime.bundle import FORMAT_VERSION, MANIFEST

PROMPT = "hello world"
STATS_KEYS = {"tokens_generated", "stop_reason", "drafter", "draft_tokens_k", "target_calls",
              "draft_calls", "drafted_tokens", "accepted_tokens", "acceptance_rate",
              "acceptance_per_position", "tokens_per_target_call", "draft_cost_ratio_c",
              "ideal_speedup", "decode_tokens_per_second"}


def cli_command() -> list[str]:
    """The installed console script when there is one, else `python -m specedge.cli`."""
    script = shutil.which("specedge", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "specedge.cli"]


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*cli_command(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def call_main(capsys, *args) -> tuple[int, str, str]:
    """Run `specedge ARGS` in-process; (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *words: str) -> None:
    assert "Traceback" not in err, err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("specedge"), lines[0]
    assert "error" in lines[0], lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


# ---- generate: output -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tiny_bundle) -> Generator:
    return Generator.from_bundle(tiny_bundle)


def test_generate_json_through_a_subprocess(tiny_bundle, api):
    proc = run_cli("generate", "--bundle", tiny_bundle, "--prompt", PROMPT, "--json",
                   "--max-new-tokens", 12)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert set(out) == {"text", "token_ids", "stats"}
    assert STATS_KEYS <= set(out["stats"])
    stats = out["stats"]
    expected = api.generate(PROMPT, max_new_tokens=12)
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == expected.text
    assert stats["stop_reason"] == expected.stop_reason
    assert stats["tokens_generated"] == len(out["token_ids"])
    assert stats["drafter"] == "lookup+model"   # the default drafter
    assert stats["draft_tokens_k"] == "auto"   # the greedy default
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["tokens_per_target_call"] >= 1
    assert stats["draft_calls"] > 0


def test_generate_streams_text_then_a_summary(capsys, tiny_bundle, api):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--max-new-tokens", 10)
    assert code == 0, err
    result = api.generate(PROMPT, max_new_tokens=10)
    assert out == result.text + "\n"
    assert f"{len(result.token_ids)} tokens" in err
    for word in ("tok/s", f"stop: {result.stop_reason}", "drafter lookup+model K=auto",
                 "acceptance", "tokens per target call", "c=", "ideal speedup"):
        assert word in err, err
    assert "Traceback" not in err


def test_generate_no_draft(capsys, tiny_bundle):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 12, "--no-draft")
    assert code == 0, err
    plain = json.loads(out)
    assert plain["stats"]["draft_calls"] == 0
    assert plain["stats"]["drafted_tokens"] == 0
    assert plain["stats"]["drafter"] == "none"
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 12)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == plain["token_ids"]  # greedy: token for token


def test_generate_raw_skips_the_chat_template(capsys, tiny_bundle, api):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 8, "--raw")
    assert code == 0, err
    raw = json.loads(out)
    assert raw["token_ids"] == api.generate(PROMPT, max_new_tokens=8, raw=True).token_ids
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 8)
    assert code == 0, err
    templated = json.loads(out)
    assert templated["token_ids"] == api.generate(PROMPT, max_new_tokens=8).token_ids
    assert api.codec.has_chat_template


def test_generate_compare_streaming(capsys, tiny_bundle):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--max-new-tokens", 8, "--compare")
    assert code == 0, err
    assert out.strip()
    assert "speculative / plain =" in err, err
    assert "median of 3 rounds taking turns (range " in err, err
    # The speeds the ratio is made of, round by round: its median is the median of their
    # ratios.
    line = next(x for x in err.splitlines() if "speculative / plain =" in x)
    pairs = re.search(r"decode tok/s speculative/plain by round ([\d./, ]+);", line).group(1)
    ratios = [float(a) / float(b) for a, b in (p.split("/") for p in pairs.split(", "))]
    assert len(ratios) == 3 and all(r > 0 for r in ratios), line
    median = float(re.search(r"speculative / plain = ([\d.]+)x", line).group(1))
    assert median == pytest.approx(statistics.median(ratios), abs=0.02), line
    assert "; same tokens" in err, err   # greedy on an fp32 bundle: plain decoding's tokens


@pytest.mark.parametrize("flags,message", [
    (["--no-draft"], "drop --no-draft"),
    (["--max-new-tokens", "1"], "--max-new-tokens 2 or more"),
    (["--compare-rounds", "0"], "--compare-rounds must be >= 1")])
def test_compare_refuses_what_it_cannot_measure(capsys, tiny_bundle, flags, message):
    """Plain against plain, or a decoding speed of one token (none after the first), is not
    a speedup: exit 2 with what to change, before anything runs."""
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--compare", *flags)
    assert code == 2 and message in err and not out, err


def test_compare_says_where_and_why_greedy_tokens_differ():
    from specedge.generate_cli import _same_tokens

    assert _same_tokens([1, 2, 3], [1, 2, 3], {}) == "; same tokens"
    int8 = {"quantization": {"batch_invariant": False, "batch_max_logit_diff": 0.98}}
    said = _same_tokens([1, 2, 5, 6], [1, 2, 3], int8)
    assert said.startswith("; tokens differ from token 2: ")
    assert "not batch invariant" in said and "0.98 logits" in said
    assert "near tie" in _same_tokens([1, 4], [1, 2], {})
    assert "token 2:" in _same_tokens([1, 2], [1, 2, 3], {})   # one stopped earlier
    assert "token 2:" in _same_tokens([1, 2, 3], [1, 2], {})


def test_generate_compare_json(capsys, tiny_bundle):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--max-new-tokens", 8, "--compare", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"text", "token_ids", "stats", "plain_stats", "plain_token_ids",
                           "speedup", "speedup_rounds", "same_tokens"}
    assert result["plain_stats"]["draft_calls"] == 0
    assert result["stats"]["draft_calls"] > 0
    # Greedy on an fp32 bundle: plain decoding's tokens, and the verdict says so.
    assert result["plain_token_ids"] == result["token_ids"]
    assert result["same_tokens"] is True
    # Three rounds, speculative and plain taking turns; the speedup is their median.
    rounds = result["speedup_rounds"]
    assert len(rounds) == 3 and all(r > 0 for r in rounds)
    assert result["speedup"] == sorted(rounds)[1]


def test_generate_compare_json_sampled_has_no_token_verdict(capsys, tiny_bundle):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--max-new-tokens", 8, "--compare", "--json",
                               "--temperature", 0.7, "--seed", 3)
    assert code == 0, err
    result = json.loads(out)
    assert result["same_tokens"] is None
    assert len(result["plain_token_ids"]) == result["plain_stats"]["tokens_generated"]


def test_generate_prompt_lookup(capsys, tiny_bundle, api):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 24, "--drafter", "prompt-lookup")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["drafter"] == "prompt-lookup"
    assert result["token_ids"] == api.generate(PROMPT, max_new_tokens=24,
                                               use_draft=False).token_ids


def test_generate_self_draft_accepts_everything(capsys, tiny_self_draft_bundle):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_self_draft_bundle,
                               "--prompt", PROMPT, "--json", "--max-new-tokens", 16,
                               "--drafter", "model")
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_target_call"] > 1


# ---- generate: bad input --------------------------------------------------------------------

BAD_GENERATE = [
    # (arguments after `generate --bundle B`, words the one error line must contain)
    (["--prompt", ""], ["the message is empty", "write something to ask"]),
    (["--prompt", "   "], ["the message is empty"]),
    (["--prompt", "", "--raw"], ["prompt is empty", "give some text to continue"]),
    (["--prompt", PROMPT, "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1", "got 0"]),
    (["--prompt", PROMPT, "--max-new-tokens", "-3"], ["--max-new-tokens", ">= 1", "got -3"]),
    (["--prompt", PROMPT, "--max-new-tokens", "100000"],
     ["max_new_tokens (100000)", "context of 512"]),
    (["--prompt", "a" * 600, "--raw", "--max-new-tokens", "1"], ["prompt (600 tokens)"]),
    (["--prompt", PROMPT, "--temperature", "-1"], ["--temperature", ">= 0", "-1"]),
    (["--prompt", PROMPT, "--temperature", "nan"], ["--temperature", ">= 0"]),
    (["--prompt", PROMPT, "--top-p", "0"], ["--top-p", "(0, 1]", "0.0"]),
    (["--prompt", PROMPT, "--top-p", "1.5"], ["--top-p", "(0, 1]", "1.5"]),
    (["--prompt", PROMPT, "--top-k", "-1"], ["--top-k", ">= 0", "-1"]),
    (["--prompt", PROMPT, "--draft-tokens", "0"], ["--draft-tokens", "[1, 32]", "got 0"]),
    (["--prompt", PROMPT, "--backend", "nope"], ["invalid choice: 'nope'", "ort-cpu"]),
    (["--prompt", PROMPT, "--drafter", "ngram"], ["--drafter", "invalid choice: 'ngram'"]),
    (["--prompt", PROMPT, "--max-new-tokens", "x"], ["--max-new-tokens", "invalid int"]),
    (["--prompt", PROMPT, "--temperature", "warm"], ["--temperature", "invalid float"]),
    (["--prompt", PROMPT, "--no-such-option"], ["unrecognized arguments: --no-such-option"]),
    ([], ["required", "--prompt"]),
    # The error names the seed (not numpy's bare "expected non-negative integer").
    (["--prompt", PROMPT, "--seed", "-1"], ["seed"]),
    # --threads is checked: -1 is refused (and 1000000 would exhaust memory).
    (["--prompt", PROMPT, "--threads", "-1"], ["threads"]),
    (["--prompt", PROMPT, "--thread-spinning", "maybe"],
     ["--thread-spinning", "expected 'auto', 'on' or 'off'", "'maybe'"]),
]


@pytest.mark.parametrize("args, words", BAD_GENERATE,
                         ids=[" ".join(a[2:] or a[:1] or ["none"]) for a, _ in BAD_GENERATE])
def test_generate_bad_input_is_one_line(capsys, tiny_bundle, args, words):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, *args)
    assert_one_line_error(code, err, *words)
    assert out == ""


def test_generate_without_bundle_or_command(capsys):
    code, _, err = call_main(capsys, "generate", "--prompt", PROMPT)
    assert_one_line_error(code, err, "--bundle")
    code, _, err = call_main(capsys, "frobnicate")
    assert_one_line_error(code, err, "invalid choice: 'frobnicate'")


def _edit_manifest(bundle: Path, change) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    change(manifest)
    (bundle / MANIFEST).write_text(json.dumps(manifest))


def _garbage_target(bundle: Path) -> None:
    path = bundle / "target.onnx"
    path.write_bytes(os.urandom(path.stat().st_size))


def _truncate_target(bundle: Path) -> None:
    path = bundle / "target.onnx"
    path.write_bytes(path.read_bytes()[:1000])


BAD_BUNDLES = {
    "missing-folder": (lambda b: shutil.rmtree(b), ["bundle folder", "does not exist"]),
    "missing-manifest": (lambda b: (b / MANIFEST).unlink(), ["no manifest.json"]),
    "manifest-not-json": (lambda b: (b / MANIFEST).write_text("not json"), ["not valid JSON"]),
    "newer-format": (lambda b: _edit_manifest(b, lambda m: m.update(format_version=99)),
                     ["format_version 99", f"runtime's {FORMAT_VERSION}", "upgrade specedge"]),
    "truncated-onnx": (_truncate_target, ["target.onnx is 1000 bytes", "truncated"]),
    "garbage-onnx": (_garbage_target, ["target.onnx", "corrupt"]),
    "missing-tokenizer": (lambda b: (b / "tokenizer.json").unlink(),
                          ["bundle file missing", "tokenizer.json"]),
    "draft-other-vocab": (lambda b: _edit_manifest(
        b, lambda m: m["models"]["draft"].update(vocab_size=40)),
        ["draft's vocabulary (40 tokens)", "target's (34)"]),
}


@pytest.mark.parametrize("damage", list(BAD_BUNDLES))
def test_generate_damaged_bundle_is_one_line(capsys, tiny_bundle, tmp_path, damage):
    change, words = BAD_BUNDLES[damage]
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    change(bundle)
    code, out, err = call_main(capsys, "generate", "--bundle", bundle, "--prompt", PROMPT)
    assert_one_line_error(code, err, *words)
    assert out == ""


def test_generate_garbage_bundle_through_a_subprocess(tiny_bundle, tmp_path):
    """Also nothing from ONNX Runtime's own logger on stderr."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    _garbage_target(bundle)
    proc = run_cli("generate", "--bundle", bundle, "--prompt", PROMPT)
    assert_one_line_error(proc.returncode, proc.stderr, "corrupt")
    assert proc.stdout == ""


# ---- threads: --threads and --thread-spinning reach both sessions ----------------------------

ALLOW_SPINNING = "session.intra_op.allow_spinning"


@pytest.fixture
def opened(monkeypatch) -> list[Generator]:
    """The Generators that the command run in the test opens, in order."""
    generators = []
    from_bundle = Generator.from_bundle.__func__

    def recording(cls, *args, **kwargs):
        generators.append(from_bundle(cls, *args, **kwargs))
        return generators[-1]

    monkeypatch.setattr(Generator, "from_bundle", classmethod(recording))
    return generators


def threads_of(gen: Generator) -> list[tuple[int, str]]:
    """(intra-op threads, allow_spinning) of the target's and the draft's sessions."""
    return [(o.intra_op_num_threads, o.get_session_config_entry(ALLOW_SPINNING))
            for o in (b.session.get_session_options() for b in (gen.target, gen.draft))]


@pytest.mark.parametrize("flag, allow", [("off", "0"), ("on", "1")])
def test_generate_thread_flags_reach_both_sessions(capsys, tiny_bundle, api, opened, flag,
                                                   allow):
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 12, "--threads", 1,
                               "--thread-spinning", flag)
    assert code == 0, err
    assert threads_of(opened[0]) == [(1, allow)] * 2
    assert json.loads(out)["token_ids"] == api.generate(PROMPT, max_new_tokens=12).token_ids


def test_generate_thread_spinning_auto_is_the_default(capsys, tiny_bundle, opened):
    """Without the flag, spinning is "auto": decided from the CPUs' load (a bool the
    sessions got and the JSON stats report)."""
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--json", "--max-new-tokens", 12)
    assert code == 0, err
    gen = opened[0]
    assert isinstance(gen.spinning, bool)
    assert [allow for _, allow in threads_of(gen)] == ["1" if gen.spinning else "0"] * 2
    assert json.loads(out)["stats"]["threads_spinning"] is gen.spinning


def test_chat_thread_flags_reach_both_sessions(capsys, monkeypatch, tiny_bundle, opened):
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    code, _, err = call_main(capsys, "chat", "--bundle", tiny_bundle, "--threads", 2,
                             "--thread-spinning", "off")
    assert code == 0, err
    assert threads_of(opened[0]) == [(2, "0")] * 2


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_bad_thread_spinning_is_one_line(capsys, tiny_bundle, command):
    code, out, err = call_main(capsys, command, "--bundle", tiny_bundle,
                               "--thread-spinning", "1")
    assert_one_line_error(code, err, "--thread-spinning", "expected 'auto', 'on' or 'off'")
    assert out == ""


def test_serve_thread_flags_reach_both_sessions(tiny_bundle):
    pytest.importorskip("starlette", reason="specedge serve needs the serve extra")
    from specedge.serve.app import Server
    from specedge.serve.cli import _settings, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    settings = _settings(parser.parse_args(["--bundle", str(tiny_bundle), "--threads", "1",
                                            "--thread-spinning", "off"]))
    assert (settings.threads, settings.spinning) == (1, False)
    # The app's own loader (the one `build_app` uses) opens the bundle with them.
    assert threads_of(Server(settings).engine.load()) == [(1, "0")] * 2


# ---- export ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_checkpoints, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`specedge export` of the tiny Llama checkpoint, without a draft."""
    out = tmp_path_factory.mktemp("cli-export") / "bundle"
    return out, run_cli("export", tiny_checkpoints["llama"], "--out", out)


def test_export_writes_a_bundle(exported):
    out, proc = exported
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout) == {"bundle": str(out), "models": {"target": "target.onnx"}}
    assert {"manifest.json", "target.onnx", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    gen = Generator.from_bundle(out)
    assert gen.bundle.draft is None
    assert gen.generate(PROMPT, max_new_tokens=4, use_draft=False).token_ids


def test_export_second_run_is_up_to_date(exported, tiny_checkpoints):
    out, first = exported
    assert first.returncode == 0, first.stderr
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    proc = run_cli("export", tiny_checkpoints["llama"], "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout) == json.loads(first.stdout)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_export_takes_the_model_as_an_option_too(exported, tiny_checkpoints, capsys):
    """`specedge export --model X` is the positional form: the same export arguments, so the
    bundle written by the positional form is up to date for it."""
    out, first = exported
    assert first.returncode == 0, first.stderr
    proc = run_cli("export", "--model", tiny_checkpoints["llama"], "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stderr
    assert json.loads(proc.stdout) == json.loads(first.stdout)
    for args in ([tiny_checkpoints["llama"], "--model", tiny_checkpoints["llama"]], []):
        code, stdout, err = call_main(capsys, "export", *args, "--out", out)
        assert_one_line_error(code, err, "give the model once")
        assert stdout == ""


def test_generate_on_a_bundle_without_draft(capsys, exported):
    out, first = exported
    assert first.returncode == 0, first.stderr
    code, stdout, err = call_main(capsys, "generate", "--bundle", out, "--prompt", PROMPT)
    assert_one_line_error(code, err, "no draft model", "--drafter prompt-lookup", "--no-draft")
    assert stdout == ""
    for extra in (["--drafter", "prompt-lookup"], ["--no-draft"]):
        code, stdout, err = call_main(capsys, "generate", "--bundle", out, "--prompt", PROMPT,
                                      "--json", "--max-new-tokens", 6, *extra)
        assert code == 0, err
        assert len(json.loads(stdout)["token_ids"]) >= 1


def test_export_nonexistent_model_is_one_line(tmp_path):
    """A model that does not exist is one line on stderr: no tqdm progress-bar lines with the
    error glued onto one of them (export/bundle_writer.py)."""
    out = tmp_path / "bundle"
    proc = run_cli("export", tmp_path / "no-such-model", "--out", out)
    assert_one_line_error(proc.returncode, proc.stderr, "no-such-model",
                          "is not a checkpoint folder")
    assert proc.stdout == ""
    assert not out.exists()


def test_distill_zero_generate_batch_is_one_line(capsys, tiny_checkpoints, tmp_path):
    out = tmp_path / "draft"
    code, stdout, err = call_main(capsys, "distill", "--target", tiny_checkpoints["llama"],
                                  "--out", out, "--generate-batch", "0")
    assert_one_line_error(code, err, "--generate-batch", ">= 1")
    assert stdout == ""
    assert not out.exists()


@pytest.fixture(scope="module")
def other_ids_checkpoint(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("other-ids") / "ckpt", other_ids=True)


@pytest.mark.parametrize("case", ["other-tokenizer-draft", "too-many-draft-layers",
                                  "max-context-zero", "draft-and-draft-layers"])
def test_export_bad_input_is_one_line(capsys, tiny_checkpoints, other_ids_checkpoint,
                                      tmp_path, case):
    """One line on stderr even where the error comes after progress output has started (the
    first two: export's tqdm bar, plus transformers' "Loading weights" bars)."""
    model = tiny_checkpoints["llama"]
    args, words = {
        "other-tokenizer-draft": (["--draft", other_ids_checkpoint],
                                  ["tokenizer maps tokens to different ids"]),
        "too-many-draft-layers": (["--draft-layers", "5"], ["--draft-layers", "got 5"]),
        "max-context-zero": (["--max-context", "0"], ["--max-context", ">= 1", "got 0"]),
        "draft-and-draft-layers": (["--draft", model, "--draft-layers", "1"],
                                   ["not allowed with argument"]),
    }[case]
    out = tmp_path / "bundle"
    code, stdout, err = call_main(capsys, "export", model, "--out", out, *args)
    assert_one_line_error(code, err, *words)
    assert stdout == ""
    assert not out.exists()


def test_bare_specedge_prints_its_commands(capsys):
    code, out, err = call_main(capsys)
    assert code == 2 and not out
    for command in ("generate", "chat", "serve", "export", "bench"):
        assert command in err
    assert "usage: specedge" in err


def test_generate_stop_system_and_prompt_files(capsys, tiny_bundle, api, tmp_path,
                                               monkeypatch):
    """--stop ends the text as the API's stop does; --system puts a system message before
    the prompt; --prompt-file FILE and '-' (stdin) read the prompt as --prompt takes it."""
    full = api.generate(PROMPT, max_new_tokens=24)
    stop = full.text[5:8]
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--max-new-tokens", 24, "--stop", "zzz", "--stop", stop,
                               "--json")
    assert code == 0, err
    stopped = json.loads(out)
    assert stopped["text"] == api.generate(PROMPT, max_new_tokens=24, stop=["zzz", stop]).text
    assert stop not in stopped["text"] and stopped["stats"]["stop_reason"] == "stop_string"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                               "--system", "be brief", "--json", "--max-new-tokens", 8)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == api.generate(messages=messages,
                                                        max_new_tokens=8).token_ids
    code, _, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt", PROMPT,
                             "--system", "x", "--raw")
    assert_one_line_error(code, err, "--system needs the chat template")

    long_prompt = " ".join(["hello world"] * 20)
    (tmp_path / "p.txt").write_text(long_prompt, encoding="utf-8")
    expected = api.generate(long_prompt, max_new_tokens=8).token_ids
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt-file",
                               tmp_path / "p.txt", "--json", "--max-new-tokens", 8)
    assert code == 0 and json.loads(out)["token_ids"] == expected, err

    class Stdin(io.StringIO):
        buffer = io.BytesIO(long_prompt.encode())

    monkeypatch.setattr(sys, "stdin", Stdin())
    code, out, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt-file",
                               "-", "--json", "--max-new-tokens", 8)
    assert code == 0 and json.loads(out)["token_ids"] == expected, err
    (tmp_path / "bad.txt").write_bytes(b"ok \xff")
    code, _, err = call_main(capsys, "generate", "--bundle", tiny_bundle, "--prompt-file",
                             tmp_path / "bad.txt")
    assert_one_line_error(code, err, "not UTF-8", "byte 3")


def test_serve_takes_a_draft_threshold_and_checks_it_before_loading(capsys, tmp_path):
    code, _, err = call_main(capsys, "serve", "--bundle", tmp_path / "none",
                             "--draft-threshold", "1.5")
    assert_one_line_error(code, err, "draft_threshold must be in [0, 1)")


def test_distill_names_its_model_as_export_does():
    """`distill` takes its target as export takes its model (positional or --model; --target
    stays), and the draft's head size as --draft-head-tokens, export's name for it."""
    from specedge.export.cli import add_distill_arguments, model_argument

    p = argparse.ArgumentParser()
    add_distill_arguments(p)
    for argv in (["ckpt"], ["--model", "ckpt"], ["--target", "ckpt"]):
        assert model_argument(p.parse_args([*argv, "--out", "d"]), "distill", "dflt") == "ckpt"
    assert model_argument(p.parse_args(["--out", "d"]), "distill", "dflt") == "dflt"
    assert p.parse_args(["--out", "d", "--draft-head-tokens", "100"]).head_tokens == 100
    assert p.parse_args(["--out", "d", "--head-tokens", "100"]).head_tokens == 100
    # "auto", as export's flag takes it: the distilled default.
    assert p.parse_args(["--out", "d", "--draft-head-tokens", "auto"]).head_tokens == 8192
    assert p.parse_args(["--out", "d"]).head_tokens == 8192


def test_distill_head_tokens_that_are_no_number_are_one_line(capsys, tmp_path):
    code, _, err = call_main(capsys, "distill", "--out", tmp_path / "d", "--draft-head-tokens",
                             "many")
    assert_one_line_error(code, err, "expected an integer or 'auto'", "'many'")


def test_each_command_runs_what_its_table_row_names(monkeypatch):
    """specedge/cli.py's one table: the parsed command's own `run`, given the namespace, and
    its return value the exit status."""
    from specedge import cli

    seen = []
    rows = [c.__class__(c.name, c.help, c.add_arguments,
                        lambda args, name=c.name: seen.append((name, args.command)) or 3,
                        c.parser_options) for c in cli.COMMANDS]
    monkeypatch.setattr(cli, "COMMANDS", tuple(rows))
    for row in rows:
        argv = [row.name] + {"generate": ["--bundle", "b", "--prompt", "p"],
                             "chat": ["--bundle", "b"], "serve": ["--bundle", "b"],
                             "export": ["m", "--out", "o"], "distill": ["--out", "o"],
                             "corpus": ["--bundle", "b", "--out", "o"],
                             "build": ["--bundle", "b"], "bench": ["--bundle", "b"]
                             }.get(row.name, [])
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 3 and seen[-1] == (row.name, row.name)


def test_distill_with_two_models_is_one_line(capsys, tmp_path):
    code, _, err = call_main(capsys, "distill", "a", "--model", "b", "--out", tmp_path / "d")
    assert_one_line_error(code, err, "give the model once", "specedge distill MODEL")


def test_export_backend_is_onnx_or_tensorrt(capsys, tmp_path):
    """A runtime backend's name is not an export backend: the message says which is."""
    code, _, err = call_main(capsys, "export", "m", "--out", tmp_path / "b", "--backend",
                             "ort-cpu")
    assert_one_line_error(code, err, "ort-cpu runs the bundle's ONNX graphs",
                          "--backend onnx")


def test_generate_checks_settings_before_the_bundle_loads(capsys, tmp_path):
    """A bad setting is reported though the bundle does not even exist: nothing was loaded
    before the check."""
    code, _, err = call_main(capsys, "generate", "--bundle", tmp_path / "nothing-here",
                             "--prompt", PROMPT, "--temperature", "-1")
    assert_one_line_error(code, err, "--temperature must be a number >= 0")
    code, _, err = call_main(capsys, "chat", "--bundle", tmp_path / "nothing-here",
                             "--top-p", "2")
    assert_one_line_error(code, err, "--top-p must be in (0, 1]")


def test_every_flag_with_a_default_says_it_in_its_help():
    """`--help` tells each flag's default (a flag whose default is "not given" excepted)."""
    from specedge.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, command in commands.choices.items():
        for action in command._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            if "default" not in (action.help or "").lower():
                silent.append(f"{name} {action.option_strings[0]}")
    assert not silent, silent


def test_export_prints_no_library_warnings(tiny_checkpoints, tmp_path):
    """The tracer's constants, the exporter's opset note and transformers' renamed cache
    argument are not the user's to act on: an export with --verify prints none of them."""
    r = run_cli("export", tiny_checkpoints["llama"], "--out", tmp_path / "b", "--draft-layers",
                "1", "--verify", "--measure-prompts", "0")
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr, r.stderr
