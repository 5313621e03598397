"""Model sources: a Hugging Face Hub id resolves from the local Hugging Face cache offline,
and one that would need the network is refused in one line that says so."""

from __future__ import annotations

import shutil

import huggingface_hub
import pytest

from specedge.export.bundle_writer import export_bundle
from specedge.export.sources import is_hub_id, resolve_checkpoint

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in a temporary HF_HOME, offline: nothing may try the
    network. huggingface_hub reads its settings when imported, so they are set both in the
    environment and in its constants."""
    home = tmp_path / "hf-home"
    hub = home / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub


def cache_entry(hub, repo_id: str, checkpoint) -> object:
    """Lay `checkpoint` out in the cache as huggingface_hub does: the files under
    models--owner--name/snapshots/<revision>/ and refs/main naming that revision."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "drafts" / "mine").mkdir(parents=True)
    assert not is_hub_id("drafts/mine")  # a local folder of that shape stays local
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("name")


def test_hub_id_in_the_cache_resolves_offline(offline_hub, tiny_checkpoints, tmp_path):
    snapshot = cache_entry(offline_hub, "tiny-org/tiny-llama", tiny_checkpoints["llama"])
    assert resolve_checkpoint("tiny-org/tiny-llama") == snapshot
    manifest = export_bundle("tiny-org/tiny-llama", tmp_path / "b", draft_layers=1)
    assert manifest["models"]["target"]["architecture"] == "llama"
    assert manifest["source"]["model"] == "tiny-org/tiny-llama"
    assert (tmp_path / "b" / "target.onnx").is_file()


def test_hub_id_that_needs_the_network_says_so(offline_hub):
    with pytest.raises(ValueError) as info:
        resolve_checkpoint("tiny-org/not-downloaded")
    message = str(info.value)
    assert "'tiny-org/not-downloaded' is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and "\n" not in message


def test_hub_id_without_network_through_the_command(offline_hub, tmp_path, capsys):
    """The command prints the same single line and exits with status 2."""
    from specedge.cli import main

    with pytest.raises(SystemExit) as info:
        main(["export", "tiny-org/not-downloaded", "--out", str(tmp_path / "b")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the local Hugging Face cache" in err[0], err


def test_hub_repository_that_is_not_a_checkpoint(offline_hub, tmp_path):
    """A cached repository without config.json (a GGUF-only one, say) is named as such."""
    files = tmp_path / "gguf-repo"
    files.mkdir()
    (files / "model.Q4_0.gguf").write_bytes(b"GGUF")
    (files / "README.json").write_text("{}")
    cache_entry(offline_hub, "tiny-org/tiny-gguf", files)
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_checkpoint("tiny-org/tiny-gguf")


def test_checkpoint_folder_and_gguf_paths_are_unchanged(tiny_checkpoints, tmp_path):
    assert resolve_checkpoint(str(tiny_checkpoints["gpt2"])) == tiny_checkpoints["gpt2"]
    with pytest.raises(ValueError, match="is not a checkpoint folder"):
        resolve_checkpoint(str(tmp_path / "missing.gguf"))

