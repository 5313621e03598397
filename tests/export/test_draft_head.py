"""Drafts that score a subset of the head's tokens (`--draft-head-tokens`): which ids, the
graph's -inf outside them, exact decoding with them, and the option's checks."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tiny_models import BOS, EOS, VOCAB, char_tokenizer, save_tiny, tiny_model

from specedge.cli import main
from specedge.export.bundle_writer import export_bundle
from specedge.export.drafts.truncated import (
    AUTO_HEAD_TOKENS,
    attach_head,
    draft_head_size,
    head_subset_ids,
    limit_draft_head,
)
from specedge.prompts import load_prompts
from specedge.runtime import Generator
from specedge.runtime.bundle import graph_io, load_bundle


def draft_logits(bundle) -> np.ndarray:
    """The bundle's draft graph on three tokens from an empty cache: logits [3, V]."""
    spec = load_bundle(bundle).draft
    session = ort.InferenceSession(str(spec.path))
    inputs, _ = graph_io(spec.num_layers)
    feeds = {"input_ids": np.array([[5, 6, 7]]), "position_ids": np.array([[0, 1, 2]]),
             "past_length": np.array([0]), "logits_to_keep": np.array([3])}
    for name in inputs[4:]:
        feeds[name] = np.zeros((1, spec.num_kv_heads, 4, spec.head_dim), np.float32)
    return session.run(None, feeds)[0][0]


def test_chosen_ids_are_unique_in_range_and_keep_the_special_tokens():
    tok = char_tokenizer()
    for n in (1, 3, 5, 12, 34):
        ids = head_subset_ids(tok, len(VOCAB), n, always=[EOS]).tolist()
        assert len(ids) == n and ids == sorted(set(ids))
        assert all(0 <= i < len(VOCAB) for i in ids)
        assert EOS in ids
        if n >= 3:
            assert {BOS, EOS, 0} <= set(ids)  # <s>, </s>, <unk>
    # never an id beyond the tokenizer (a padded embedding's rows are no token)
    assert head_subset_ids(tok, 40, 40).tolist() == list(range(len(VOCAB)))


def test_prompt_tokens_come_before_the_lowest_ids():
    """After the special tokens, the bundled prompts' tokens by frequency, then low ids."""
    tok = char_tokenizer()
    counts = Counter()
    for prompt in load_prompts():
        counts.update(tok(prompt["prompt"], add_special_tokens=False)["input_ids"])
    by_frequency = [i for i, _ in counts.most_common() if i > 2]
    for extra in (1, 4, 10):
        want = {0, BOS, EOS, *by_frequency[:extra]}
        assert set(head_subset_ids(tok, len(VOCAB), 3 + extra).tolist()) == want
    # characters the prompts never use ('q' may be among them) fill up from the lowest id
    unused = [i for i in range(3, len(VOCAB)) if i not in counts]
    n = 3 + len(by_frequency) + 1
    if unused:
        assert set(head_subset_ids(tok, len(VOCAB), n).tolist()) == \
            {0, BOS, EOS, *by_frequency, unused[0]}


def test_smollm2_subset_holds_its_chat_tokens_and_common_words():
    from transformers import AutoTokenizer

    from specedge.export.sources import resolve_checkpoint

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
    ids = set(head_subset_ids(tok, 49152, 2048).tolist())
    assert len(ids) == 2048
    assert {tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")} <= ids
    assert set(tok(" the the. and", add_special_tokens=False)["input_ids"]) <= ids


def test_auto_head_size():
    assert draft_head_size("auto", 128256) == draft_head_size(None, 128256) == AUTO_HEAD_TOKENS
    assert draft_head_size("auto", 49152) is None
    assert draft_head_size("all", 128256) is None
    assert draft_head_size(128256, 128256) is None
    assert draft_head_size(100, 128256) == 100


def test_limit_keeps_only_ids_an_earlier_limit_allows():
    model = tiny_model("llama", vocab_size=40)
    limit_draft_head(model, torch.arange(40))
    assert getattr(model, "specedge_head_ids", None) is None  # every token: the plain head
    attach_head(model, torch.arange(34))  # a padded checkpoint's rows 34-39 are no token
    limit_draft_head(model, torch.tensor([30, 2, 36, 5, 2]))
    assert model.specedge_head_ids.tolist() == [2, 5, 30]
    with pytest.raises(ValueError, match=r"in \[0, 40\)"):
        limit_draft_head(model, torch.tensor([40]))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_exported_subset_draft_scores_only_its_tokens(tiny_checkpoints, tmp_path, precision):
    out = tmp_path / "b"
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1,
                             draft_head_tokens=12, precision=precision)
    assert manifest["models"]["draft"]["head_tokens"] == 12
    assert manifest["source"]["draft_head_tokens"] == 12
    chosen = head_subset_ids(char_tokenizer(), len(VOCAB), 12, always=[EOS]).numpy()
    logits = draft_logits(out)
    outside = np.setdiff1d(np.arange(len(VOCAB)), chosen)
    assert logits.shape == (3, len(VOCAB))
    assert np.isneginf(logits[:, outside]).all() and np.isfinite(logits[:, chosen]).all()
    # the target still scores every token
    assert "head_tokens" not in manifest["models"]["target"]


def test_subset_draft_decodes_exactly(tiny_checkpoints, tmp_path):
    """Greedy speculative decoding with a 12-token draft head equals plain decoding, also
    where the target emits tokens the draft can never propose (q = 0)."""
    out = tmp_path / "b"
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1,
                             draft_head_tokens=12, verify=True)
    assert manifest["verify"]["draft"]["ok"], manifest["verify"]  # on its 12 tokens
    assert manifest["models"]["draft"]["head_tokens"] == 12
    chosen = set(head_subset_ids(char_tokenizer(), len(VOCAB), 12, always=[EOS]).tolist())
    gen = Generator.from_bundle(out)
    for prompt in ("the cat sat", "hello world, how are you?"):
        plain = gen.generate(prompt, raw=True, max_new_tokens=40, use_draft=False)
        spec = gen.generate(prompt, raw=True, max_new_tokens=40, draft_tokens=3,
                            drafter="model")
        assert spec.token_ids == plain.token_ids
        assert spec.stats["drafted_tokens"] > 0
    assert set(plain.token_ids) - chosen  # tokens outside the draft's head were emitted


def test_checkpoint_draft_takes_the_subset(tiny_checkpoints, tmp_path):
    out = tmp_path / "b"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft=str(tiny_checkpoints["llama"]),
                  draft_head_tokens=20)
    assert json.loads((out / "manifest.json").read_text())["models"]["draft"][
        "head_tokens"] == 20
    assert np.isneginf(draft_logits(out)).sum(axis=-1).tolist() == [14, 14, 14]


def test_auto_limits_a_large_vocabulary(tmp_path):
    """Above 65536 tokens a truncated draft scores at most AUTO_HEAD_TOKENS of them: here
    the 34 the tokenizer has (the other ids are no token)."""
    ckpt = save_tiny(tmp_path / "big", "llama", vocab_size=70000)
    manifest = export_bundle(str(ckpt), tmp_path / "b", draft_layers=1)
    assert manifest["models"]["draft"]["head_tokens"] == len(VOCAB)
    assert manifest["source"]["draft_head_tokens"] == "auto"
    assert np.isfinite(draft_logits(tmp_path / "b")).sum(axis=-1).tolist() == [34] * 3


def test_another_head_setting_is_re_exported(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "b"
    export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1, draft_head_tokens=12)
    capsys.readouterr()
    export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1, draft_head_tokens=12)
    assert "up to date" in capsys.readouterr().err
    manifest = export_bundle(str(tiny_checkpoints["llama"]), out, draft_layers=1,
                             draft_head_tokens="all")
    assert "up to date" not in capsys.readouterr().err
    assert "head_tokens" not in manifest["models"]["draft"]


@pytest.mark.parametrize("setting", [0, -3, 35, 10**6, "many", 2.5, True])
def test_bad_head_sizes_are_refused(tiny_checkpoints, tmp_path, setting):
    with pytest.raises(ValueError, match=r"--draft-head-tokens must be an integer in \[1, 34\]"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft_layers=1,
                      draft_head_tokens=setting)
    assert not (tmp_path / "b").exists()


def test_head_size_without_a_draft_that_takes_it_is_refused(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="applies to a draft made with --draft-layers"):
        export_bundle(str(tiny_checkpoints["llama"]), tmp_path / "b", draft_head_tokens=8)


@pytest.mark.parametrize(("value", "said"), [("0", "must be an integer in [1, 34]"),
                                             ("35", "must be an integer in [1, 34]"),
                                             ("lots", "expected an integer, 'all' or 'auto'")])
def test_command_refuses_bad_head_sizes_in_one_line(tiny_checkpoints, tmp_path, capsys, value,
                                                    said):
    with pytest.raises(SystemExit) as info:
        main(["export", str(tiny_checkpoints["llama"]), "--out", str(tmp_path / "b"),
              "--draft-layers", "1", "--draft-head-tokens", value])
    assert info.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
