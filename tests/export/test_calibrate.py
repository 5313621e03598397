"""`specedge export` measures a new bundle's draft (auto_k.json) so that auto K starts from
its acceptance: written after the export, kept while the bundle is up to date, skipped with
--measure-prompts 0 or without a draft."""

from __future__ import annotations

import json

from specedge.cli import main
from specedge.runtime import Generator
from specedge.runtime.drafting import auto_k_file


def export(capsys, checkpoint, out, *args) -> dict:
    capsys.readouterr()
    main(["export", str(checkpoint), "--out", str(out), *map(str, args)])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_export_stores_the_drafts_measurements(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "b"
    said = export(capsys, tiny_checkpoints["llama"], out, "--draft-layers", "1",
                  "--measure-prompts", "3")
    path = out / auto_k_file.FILE
    assert said["auto_k"] == str(path)
    record = json.loads(path.read_text())
    # The default drafter's sources, greedy, counted over the three prompts' steps.
    sources = {e["source"] for e in record["acceptance"] if e["greedy"]}
    assert "lookup+model/model" in sources
    model = next(e for e in record["acceptance"] if e["source"] == "lookup+model/model")
    assert model["steps"] > 3 and model["tries"][0] > 0
    (machine,) = record["machines"]
    assert machine["machine"] == auto_k_file.machine_of("ort-cpu", None)
    assert machine["written_by"] == "specedge export"
    assert {e["tokens"] for e in machine["verify_seconds"]} >= {1, 2}
    # A Generator on this machine starts from all of it.
    gen = Generator.from_bundle(out)
    assert gen.stored_costs
    assert gen._histories.of("lookup+model/model", True).tries[0] > 0

    # Up to date: neither the bundle nor its measurements are redone.
    before = path.read_text()
    said = export(capsys, tiny_checkpoints["llama"], out, "--draft-layers", "1",
                  "--measure-prompts", "3")
    assert said["auto_k"] == str(path) and path.read_text() == before
    # A re-export replaces the folder, measurements included; 0 skips measuring.
    said = export(capsys, tiny_checkpoints["llama"], out, "--draft-layers", "1",
                  "--measure-prompts", "0", "--force")
    assert "auto_k" not in said and not path.exists()


def test_no_draft_no_measurement(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "b"
    said = export(capsys, tiny_checkpoints["llama"], out)
    assert "auto_k" not in said and not (out / auto_k_file.FILE).exists()



def test_a_failed_measurement_warns_and_the_export_succeeds(tiny_checkpoints, tmp_path,
                                                           capsys, monkeypatch):
    """Measuring the draft is optional. When every prompt encodes to no tokens (as with a
    word-level tokenizer that knows none of their words) there is nothing to measure; when
    the measurement raises, the export warns. Either way it prints its JSON line, the bundle
    opens, and no auto_k.json is written."""
    from specedge.export import calibrate

    def no_tokens(self, *args, **kwargs):
        raise ValueError("the prompt encodes to no tokens: give some text to continue")

    with monkeypatch.context() as m:
        m.setattr(Generator, "encode_prompt", no_tokens)
        said = export(capsys, tiny_checkpoints["llama"], tmp_path / "b", "--draft-layers",
                      "1", "--measure-prompts", "3")
    assert said["auto_k"] is None and not (tmp_path / "b" / auto_k_file.FILE).exists()
    assert Generator.from_bundle(tmp_path / "b").generate("hello", max_new_tokens=2).token_ids

    def broken(bundle, prompts):
        raise RuntimeError("the measurement broke")

    monkeypatch.setattr(calibrate, "calibrate", broken)
    capsys.readouterr()
    main(["export", str(tiny_checkpoints["llama"]), "--out", str(tmp_path / "c"),
          "--draft-layers", "1", "--measure-prompts", "3"])
    printed = capsys.readouterr()
    assert json.loads(printed.out.strip().splitlines()[-1])["auto_k"] is None
    assert "warning" in printed.err and "the measurement broke" in printed.err
    assert (tmp_path / "c" / "manifest.json").exists()
